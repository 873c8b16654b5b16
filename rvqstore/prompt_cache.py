"""Saving, loading and resuming prompt caches as ``.rvq`` files.

``save_prompt_cache`` writes only the used tokens of each layer (codes, scales, and any
full-precision window), the prompt's token ids and, given the model, its fingerprint.
``load_prompt_cache`` rebuilds the caches bit for bit and refuses a file made for another model.
``resume`` finds the longest common prefix between a new prompt and the stored tokens and returns the
caches trimmed to it, with the tokens still to compute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .cache import RVQKVCache
from .cache_kinds import convert_caches, make_caches
from .snapshot.decode import decode_snapshot
from .snapshot.encode import encode_snapshot, is_empty, snapshot_token_count
from .snapshot.resume_rules import cut_to, longest_valid_prefix
from .snapshot.structure import structure_mismatch
from .codec import DEFAULT_BITS
from .errors import InvalidArgumentError, ModelMismatchError, RVQError
from .format import MalformedHeaderError, Section, open_rvq, write_rvq
from .model_check import check_fingerprint, check_geometry
from .model_check import fingerprint as _fingerprint  # memoized; also used by rvqstore.store
from .save_arguments import parse_metadata, parse_token_ids

class NoTokensError(RVQError, ValueError):
    """A snapshot without token ids cannot be resumed by prefix."""


def _check_structure(layers: Any, model: Any, where: str) -> None:
    why = structure_mismatch(layers, model)
    if why is not None:
        raise ModelMismatchError(f"{where}: {why}")


class _LayerView:
    """What :func:`structure_mismatch` reads from a layer map, for caches about to be saved."""

    def __init__(self, m: dict) -> None:
        self.kind, self.max_size, self.keep, self.n_arrays = m["kind"], m.get("max_size"), m.get("keep"), m.get("n_arrays")
        self.children = [_LayerView(c) for c in m.get("children", ())]


def save_prompt_cache(path: str | os.PathLike, cache: Sequence[Any], *, tokens: Sequence[int] | None = None,
                      metadata: dict[str, str] | None = None, model: Any = None, tokenizer: Any = None,
                      bits: tuple[int, int] = DEFAULT_BITS, seed: int = 0, residual: str = "conditional",
                      compress: str = "auto", progress: Callable[[int, int | None], None] | None = None) -> int:
    """Write ``cache`` (a list, one entry per layer) to ``path`` as an ``.rvq`` snapshot.

    Entries may be rvqstore caches (:class:`RVQKVCache`, :class:`RVQRotatingKVCache`), mlx-lm ``KVCache`` /
    ``QuantizedKVCache`` / ``RotatingKVCache`` (encoded with ``bits``/``seed``/``residual``), ``ArraysCache``
    (recurrent state, stored in full precision) or a ``CacheList`` of these. ``tokens``: the ids the cache
    holds (needed for :func:`resume`; their count must equal the cache's offset). ``model`` (and
    ``tokenizer``): store their fingerprint, and the model's name/path, so loading into another model is
    refused. The write is atomic: an interrupted save leaves any previous file at ``path`` untouched.
    Returns the file size in bytes.
    """
    metadata = parse_metadata(metadata)  # typed errors before any work or file change
    if tokens is not None:
        tokens = parse_token_ids(tokens)
    caches = convert_caches(cache, dict(bits=bits, seed=seed, residual=residual), {})
    if not caches or any(is_empty(c) for c in caches):
        raise RVQError("cannot save an empty cache (run the prompt through the model first)")
    n_tokens = snapshot_token_count(caches, None if tokens is None else len(tokens))
    if tokens is not None and len(tokens) != n_tokens:
        raise InvalidArgumentError(f"tokens has {tokens.size} ids but the cache holds {n_tokens} tokens")
    layers, layer_sections, quantizer_keys = encode_snapshot(caches, n_tokens)
    fingerprint = None
    if model is not None:
        _check_structure([_LayerView(m) for m in layers], model, "the cache")
        check_geometry(layers, model, path="the cache", has_fingerprint=True)  # heads and head dims too
        fingerprint = _fingerprint(model, tokenizer)

    sections = []
    if tokens is not None:
        sections.append(Section("tokens", -1, "tokens", tokens.astype(np.int32)))
    sections += layer_sections
    header = {
        "n_tokens": n_tokens,
        "layers": layers,
        **quantizer_keys,
        "model": fingerprint,
        "metadata": metadata,
        "cache": _cache_settings(caches),
    }
    write_rvq(path, header, sections, compress=compress, progress=progress)
    return os.path.getsize(path)


def _cache_settings(caches: Sequence[Any]) -> dict:
    """The ``cache`` extension map: mode (from the first RVQ cache) and dense window settings."""
    flat = _flat(caches)
    plain = next((c for c in flat if isinstance(c, RVQKVCache)), None)
    mode = next((c.mode for c in flat if hasattr(c, "codec_bits")), "packed")
    if plain is None:
        return {"mode": mode, "dense_window": 0, "flush_block": 64}
    return {"mode": mode, "dense_window": plain.dense_window, "flush_block": plain.flush_block}


def _flat(caches: Sequence[Any]) -> list:
    from mlx_lm.models.cache import CacheList

    out = []
    for c in caches:
        out.extend(_flat(c.caches) if isinstance(c, CacheList) else [c])
    return out


def check_model(file_fp: dict | None, model: Any, tokenizer: Any = None, *, path: str = "") -> None:
    """Raise ModelMismatchError if the snapshot's fingerprint lacks an identity key or differs from
    ``model``'s (and tokenizer's); the message names the model the snapshot was made with (its stored
    ``source``). Geometry is checked from the layer maps by loads (:mod:`rvqstore.model_check`)."""
    check_fingerprint(file_fp, model, tokenizer, path=path)


def _check_file_against_model(f, model: Any, tokenizer: Any) -> None:
    check_fingerprint(f.model, model, tokenizer, path=f.path)  # first: its message names the right model
    _check_structure(f.layers, model, f.path)
    check_geometry(f.layers, model, path=f.path, has_fingerprint=f.model is not None)  # with or without one


def _cache_options(f) -> dict:
    """The snapshot's ``cache`` extension map (mode, window), validated: a crafted header must not
    reach the cache constructor as arbitrary types."""
    opts = f.header.raw.get("cache") or {}
    ok = isinstance(opts, dict) and opts.get("mode", "packed") in ("packed", "resident") and all(
        type(opts.get(k, 1)) is int and opts.get(k, 1) >= lo for k, lo in (("dense_window", 0), ("flush_block", 1)))
    if not ok:
        raise MalformedHeaderError(f.path, f"header.cache is malformed: {opts!r}"[:300])
    return {"mode": opts.get("mode", "packed"), "dense_window": opts.get("dense_window", 0),
            "flush_block": opts.get("flush_block", 64)}


def load_prompt_cache(path: str | os.PathLike, *, model: Any = None, tokenizer: Any = None,
                      return_metadata: bool = False, mode: str | None = None, use_kernels: bool = True,
                      max_decoded_bytes: int | None = None):
    """Load an ``.rvq`` snapshot as a list of caches (one per layer, of the kinds that were saved).

    A file that would decode to more than ``max_decoded_bytes`` (default: ``RVQSTORE_MAX_DECODED_BYTES``
    or 16 GiB) is refused with ``LimitExceededError`` before anything is decoded.

    With ``model`` (and ``tokenizer``), a snapshot whose fingerprint or layer kinds differ is refused
    with :class:`ModelMismatchError`. ``mode`` overrides the stored cache mode (``"packed"``/``"resident"``).
    With ``return_metadata`` returns ``(caches, metadata)``.
    """
    with open_rvq(path) as f:
        if model is not None:
            _check_file_against_model(f, model, tokenizer)
        caches = _read_caches(f, mode=mode, use_kernels=use_kernels, max_decoded_bytes=max_decoded_bytes)
        meta = dict(f.metadata)
    return (caches, meta) if return_metadata else caches


def _read_caches(f, *, mode: str | None, use_kernels: bool, max_decoded_bytes: int | None = None) -> list:
    if mode is not None and mode not in ("packed", "resident"):
        raise InvalidArgumentError(f"mode must be 'packed' or 'resident', got {mode!r}")
    f.check_decoded_size(max_decoded_bytes)  # bounded before any section is decoded (spec section 12)
    f.tokens()  # a load relies on every byte it keeps: the token ids' checksum too (spec 13, S3)
    opts = _cache_options(f)
    return decode_snapshot(f, mode=mode or opts["mode"], opts=opts, use_kernels=use_kernels)


@dataclass
class ResumeResult:
    """What :func:`resume` found: caches cut back to the reused prefix and the tokens left to compute."""

    cache: list
    reused: int  # prompt tokens whose keys/values (or state) come from the file
    remaining: list[int]  # prompt tokens still to run through the model (never empty)
    stored: int  # tokens the file held
    metadata: dict[str, str] = field(default_factory=dict)
    reason: str = ""  # why ``reused`` stops where it does


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def resume(path: str | os.PathLike, prompt_tokens: Sequence[int], model: Any = None, *, tokenizer: Any = None,
           mode: str | None = None, use_kernels: bool = True, max_decoded_bytes: int | None = None) -> ResumeResult:
    """Reuse the longest prefix of ``prompt_tokens`` shared with the snapshot that every layer can resume at.

    At least one prompt token is always left to compute (the model needs it to produce logits), so a
    prompt equal to the stored tokens reuses all but its last token. Layers limit how far back they can
    go: a sliding window that has moved cannot rewind below what its next token attends to, a recurrent
    state is reusable only at its exact length (then nothing is reused); ``reason`` says which limit hit.
    """
    prompt = parse_token_ids(prompt_tokens).tolist()
    if not prompt:
        raise InvalidArgumentError("prompt_tokens is empty")
    with open_rvq(path) as f:
        stored = f.tokens()
        if stored is None:
            raise NoTokensError(f"{os.fspath(path)}: the snapshot stores no token ids, so no prefix can be matched")
        if model is not None:
            _check_file_against_model(f, model, tokenizer)
        shared = common_prefix_length(stored, prompt)
        caches = _read_caches(f, mode=mode, use_kernels=use_kernels, max_decoded_bytes=max_decoded_bytes)
        meta = dict(f.metadata)
        n_stored = len(stored)
    p = min(shared, len(prompt) - 1)
    if shared < n_stored:
        reason = f"the prompt differs from the stored tokens at token {shared}"
    elif p < shared:
        reason = "the prompt is the stored tokens: its last token is computed again for its logits"
    else:
        reason = "every stored token is reused"
    reused, why = longest_valid_prefix(caches, p, n_stored)
    return ResumeResult(cut_to(caches, reused), reused, prompt[reused:], n_stored, meta, why or reason)


def make_prompt_cache(model: Any, bits: tuple[int, int] | int = DEFAULT_BITS, seed: int = 0, residual: str = "conditional",
                      max_kv_size: int | None = None, **kwargs: Any) -> list:
    """rvqstore caches following the model's own per-layer cache kinds (``model.make_cache()``).

    Plain layers get an :class:`RVQKVCache`, sliding-window layers an :class:`RVQRotatingKVCache` (same
    ``max_size``/``keep``), recurrent state (``ArraysCache``) stays as mlx-lm makes it, and a
    ``CacheList`` gets its children converted; any other kind raises :class:`UnsupportedCacheError`
    naming it and the layer (see :mod:`rvqstore.cache_kinds`). ``kwargs`` go to the RVQ caches
    (``mode``, ``dense_window``, ``step``/``value_step`` for uniform-grid codes, ``sink_tokens``/
    ``center_keys`` for the codec state of :mod:`rvqstore.cache_state`, ...; sliding-window layers take
    no ``dense_window``, one step for both sides, and no codec state: they keep mlx-lm's ``keep`` sink
    tokens as codes and never center their keys). ``max_kv_size``: as
    in mlx-lm, for models without ``make_cache``: every layer a sliding window of that many tokens
    (keeping 4 sink tokens).
    """
    codec = dict(bits=bits, seed=seed, residual=residual)
    if max_kv_size is not None and not hasattr(model, "make_cache"):
        from mlx_lm.models.cache import RotatingKVCache

        from .cache_kinds import fresh_cache

        return [fresh_cache(RotatingKVCache(max_kv_size, keep=4), codec, kwargs, f"layer {i}")
                for i in range(len(model.layers))]
    return make_caches(model, codec, kwargs)


def convert_prompt_cache(cache: Sequence[Any], bits: tuple[int, int] | int = DEFAULT_BITS, seed: int = 0,
                         residual: str = "conditional", **kwargs: Any) -> list:
    """Encode a list of mlx-lm caches (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache, CacheList)
    into their rvqstore forms; rvqstore caches and recurrent state are passed through."""
    return convert_caches(cache, dict(bits=bits, seed=seed, residual=residual), kwargs)
