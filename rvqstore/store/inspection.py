"""What ``rvqstore store ls | du | verify`` report, from a backend alone (no model needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import RVQError
from ..format import open_rvq
from .backend import Backend
from .blocks import open_block_bytes
from .index import StoreIndex, scan
from .keys import block_key


def describe_store(backend: Backend) -> dict[str, Any]:
    """Per namespace: what it is (model, codec, block size), blocks, bytes, tokens, prompts (leaves)."""
    index = scan(backend)
    out = []
    for ns, blocks in sorted(index.by_namespace().items()):
        raw = backend.get(f"{ns}/namespace.json")
        try:
            info = json.loads(raw) if raw else None
        except ValueError:
            info = None
        live = [b for b in blocks if b.depth >= 0]
        out.append({
            "namespace": ns,
            "model": (info or {}).get("model"),
            "codec": (info or {}).get("codec"),
            "block_size": (info or {}).get("block_size"),
            "blocks": len(live),
            "orphans": len(blocks) - len(live),
            "bytes": sum(b.size for b in blocks),
            "tokens": sum(b.name.n_tokens for b in live),
            "leaves": sum(1 for b in live if not b.children),
            "longest_prefix": _longest(live),
            "last_used": max((b.last_used for b in blocks), default=None),
        })
    return {"url": backend.url, "namespaces": out, "block_bytes": index.block_bytes,
            "total_bytes": index.total_bytes, "other_objects": len(index.other)}


def _longest(live) -> int:
    tokens = {}
    for b in sorted(live, key=lambda b: b.depth):
        tokens[b.name.key] = tokens.get(b.name.parent, 0) + b.name.n_tokens
    return max(tokens.values(), default=0)


@dataclass
class VerifyReport:
    checked: int
    bytes: int
    bad: list[tuple[str, str]]  # (path, reason)
    orphans: list[str]


def verify_store(backend: Backend, *, repair: bool = False, decode: bool = False) -> VerifyReport:
    """Read every block: checksums of the header and every section, the key recomputed from the
    parent and the stored token ids, the names in the header; optionally decode every code."""
    index: StoreIndex = scan(backend)
    bad: list[tuple[str, str]] = []
    total = 0
    for b in sorted(index.blocks.values(), key=lambda b: b.path):
        reason = _check_block(backend, b, decode)
        total += b.size
        if reason:
            bad.append((b.path, reason))
            if repair:
                backend.delete(b.path)
    orphans = [b.path for b in index.blocks.values() if b.depth < 0]
    return VerifyReport(len(index.blocks), total, bad, orphans)


def _check_block(backend: Backend, b, decode: bool) -> str | None:
    local = backend.local_path(b.path)
    try:
        if local is not None:
            f = open_rvq(local)
        else:
            data = backend.get(b.path)
            if data is None:
                return None  # removed since the listing
            f = open_block_bytes(data, b.path)
        with f:
            decoder = None
            if decode:
                from ..format.quantizer import decode_layers

                decoder = decode_layers
            f.verify(decode=decoder)
            meta = f.metadata
            toks = f.tokens()
            if meta.get("store.key") != b.name.key or meta.get("store.parent") != b.name.parent:
                return "header names another block"
            if toks is None or len(toks) != b.name.n_tokens:
                return "token ids missing or of the wrong count"
            if block_key(b.name.parent, np.asarray(toks)) != b.name.key or int(toks[0]) != b.name.first:
                return "name does not match parent and token ids"
    except FileNotFoundError:
        return None
    except (RVQError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None
