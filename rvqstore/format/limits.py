"""How many bytes loading a file decodes, and the limit a loader holds it to (spec section 12).

A file's size does not bound what loading it allocates: 1-bit codes decode to float32 at 32x, and a
zstd section may hold 32x its stored size, so a valid file can decode to ~1000x its size.  Loaders
therefore compute the decoded size from the header alone (no section read) and refuse more than a
limit: ``max_decoded_bytes`` per call, else ``RVQSTORE_MAX_DECODED_BYTES``, else
:data:`~rvqstore.format.constants.DEFAULT_MAX_DECODED_BYTES`.
"""

from __future__ import annotations

import os

from . import constants as C

ENV_MAX_DECODED = "RVQSTORE_MAX_DECODED_BYTES"


def resolve_decoded_limit(limit: int | None = None) -> int:
    """The limit in bytes: the argument, else the environment variable, else the default."""
    if limit is None:
        env = os.environ.get(ENV_MAX_DECODED)
        if env is None or env.strip() == "":
            return C.DEFAULT_MAX_DECODED_BYTES
        try:
            limit = int(env.strip())
        except ValueError:
            raise ValueError(f"{ENV_MAX_DECODED}={env!r} is not an integer number of bytes") from None
    if type(limit) is not int or limit < 0:
        raise ValueError(f"max_decoded_bytes must be a non-negative int, got {limit!r}")
    return limit


def _layer_nbytes(layer, by_name) -> int:
    if layer.kind == C.LAYER_LIST:
        return sum(_layer_nbytes(c, by_name) for c in layer.children)
    if layer.kind == C.LAYER_ARRAYS:
        return sum(by_name[n].raw_length for n in layer.sections.values())
    rows = layer.batch * layer.n_kv_heads * layer.n_tokens  # sink positions included (codec-state)
    mean = layer.sections.get(C.MEAN_KIND)  # the key mean is held beside the keys it is added to
    return rows * (layer.head_dim * C.DTYPES[layer.key_dtype][1]
                   + layer.value_head_dim * C.DTYPES[layer.value_dtype][1]) + (by_name[mean].raw_length if mean else 0)


def decoded_nbytes(header) -> int:
    """Bytes of every layer's keys and values in their own dtypes, state arrays and token ids."""
    by_name = {s.name: s for s in header.sections}
    n = sum(_layer_nbytes(layer, by_name) for layer in header.layers)
    n += sum(s.raw_length for s in header.sections if s.kind == C.KIND_TOKENS)
    return n
