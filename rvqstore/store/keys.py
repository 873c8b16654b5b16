"""Content addresses of the prefix store: the namespace of a (model, codec, block size) and the hash
chain over token blocks, and the object names built from them.

A block's key hashes its parent's key and its own token ids, so equal keys mean equal token
prefixes (as in vLLM's prefix caching): prompts that share a prefix share its blocks, and a key
can be computed from the tokens alone, before anything is read.

Object layout under the store root::

    <ns>/namespace.json                  what the namespace is (model fingerprint, codec, block size)
    <ns>/blocks/<parent>/<key>.<n>.<t>.rvq   one block of n tokens (n <= block size) whose parent is
                                         <parent> and whose first token id is t (a lookup that
                                         leaves the stored blocks midway reads only the token ids of
                                         the children that start with its next token)
    <ns>/used/<key>                      empty marker, written when a block ends a lookup (LRU on S3)

The first block's parent is the namespace id itself.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

KEY_HEX = 32  # 128-bit blake2b keys
_BLOCK_RE = re.compile(r"^([0-9a-f]{32})/blocks/([0-9a-f]{32})/([0-9a-f]{32})\.([1-9][0-9]{0,6})\.(0|[1-9][0-9]{0,9})\.rvq$")


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=KEY_HEX // 2).hexdigest()


def namespace_info(fingerprint: dict | None, *, bits: tuple[int, int], seed: int, residual: str,
                   block_size: int) -> dict[str, Any]:
    """What identifies a namespace: blocks are shared only between equal maps."""
    fp = {k: v for k, v in (fingerprint or {}).items() if k != "source"}  # "source" is a label
    return {"model": fp, "codec": {"bits": list(bits), "seed": seed, "residual": residual},
            "block_size": block_size, "layout": 1}


def namespace_id(info: dict[str, Any]) -> str:
    return _digest(json.dumps(info, sort_keys=True, separators=(",", ":")).encode())


def block_key(parent: str, tokens: Sequence[int] | np.ndarray) -> str:
    """The key of a block: hash of the parent key and the block's int32 token ids."""
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
        raise ValueError("token ids must be in [0, 2^31)")
    return _digest(bytes.fromhex(parent) + ids.astype("<i4").tobytes())


def chain_keys(parent: str, tokens: Sequence[int] | np.ndarray, start: int, block_size: int) -> list[tuple[int, int, str]]:
    """Keys of the full blocks of ``tokens[start:]`` chained from ``parent``: ``[(start, end, key), ...]``."""
    out = []
    for s in range(start, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[s:s + block_size])
        out.append((s, s + block_size, parent))
    return out


@dataclass(frozen=True)
class BlockName:
    ns: str
    parent: str
    key: str
    n_tokens: int
    first: int  # the block's first token id

    @property
    def path(self) -> str:
        return block_path(self.ns, self.parent, self.key, self.n_tokens, self.first)


def block_path(ns: str, parent: str, key: str, n_tokens: int, first: int) -> str:
    return f"{ns}/blocks/{parent}/{key}.{n_tokens}.{int(first)}.rvq"


def children_prefix(ns: str, parent: str) -> str:
    return f"{ns}/blocks/{parent}/"


def used_path(ns: str, key: str) -> str:
    return f"{ns}/used/{key}"


def namespace_path(ns: str) -> str:
    return f"{ns}/namespace.json"


def parse_block_path(path: str) -> BlockName | None:
    """The parts of a block object's name, or None for anything else (temporary files, markers)."""
    m = _BLOCK_RE.match(path)
    if m is None:
        return None
    return BlockName(m.group(1), m.group(2), m.group(3), int(m.group(4)), int(m.group(5)))
