"""A per-machine record of weight hashes: a fresh process checks a snapshot's model without hashing every
weight again.

The fingerprint's ``weights_sha256`` (:mod:`rvqstore.fingerprint`) is SHA-256 over every weight as
float32 values: a pass over four bytes per parameter, once per process, on every save, load or resume
with ``model=`` (21.1 s for a 1.5B float16 model on this project's 2-core CPU;
``tools/results/model-check-cpu.txt``). Here each computed hash is kept under the digest of the raw
parameters it was computed from (:mod:`rvqstore.parameter_digest`, which a check computes anyway),
with MLX's version (dequantization, hence the float32 values, is MLX's) and the hash's own version. A
later process with the same raw parameters reads the hash back; any edited weight changes the digest,
so the entry no longer applies.

``RVQSTORE_WEIGHTS_CACHE``: the directory (default ``~/.cache/rvqstore/weights``), or ``off``.
Entries are small JSON files (:mod:`rvqstore.user_cache`: private, atomic, believed only when they name
their key); a damaged one is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

import mlx.core as mx

from . import user_cache
from .fingerprint import WEIGHTS_HASH_VERSION

log = logging.getLogger("rvqstore.weights_cache")

ENV = "RVQSTORE_WEIGHTS_CACHE"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _entry(digest: str) -> tuple[Path, str] | None:
    d = user_cache.directory(ENV, "weights")
    if d is None:
        return None
    key = hashlib.sha256(repr((WEIGHTS_HASH_VERSION, mx.__version__, digest)).encode()).hexdigest()
    return d / f"{key}.json", key


def lookup(digest: str) -> str | None:
    """The ``weights_sha256`` kept for parameters of this digest, or None."""
    entry = _entry(digest)
    if entry is None:
        return None
    record = user_cache.read_record(*entry)
    value = None if record is None else record.get("weights_sha256")
    return value if isinstance(value, str) and _SHA256.fullmatch(value) else None


def keep(digest: str, weights_sha256: str) -> None:
    """Record the hash computed for parameters of this digest (a disk that refuses it only logs)."""
    entry = _entry(digest)
    if entry is None or not _SHA256.fullmatch(weights_sha256):
        return
    try:
        user_cache.write_record(*entry, {"weights_sha256": weights_sha256})
    except OSError as err:
        log.info("weights cache: could not write in %s: %s", entry[0].parent, err)


__all__ = ["lookup", "keep", "ENV"]
