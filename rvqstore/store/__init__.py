"""A shared prefix store of compressed KV caches: many prompts, processes and machines reuse the
cached blocks of their common prefixes, in a local directory or on S3-compatible object storage.

Modules, one job each: ``keys`` (content addresses), ``blocks`` (a block as ``.rvq`` bytes, and
cutting caches into blocks), ``backend`` / ``local`` / ``s3`` (where bytes live, atomic publish),
``index`` (the listing as an index: sizes, LRU, gc), ``prefix_store`` (:class:`PrefixStore`),
``mlx_server`` (mlx-lm's server with its prompt cache backed by a store).
"""

from .backend import ObjectInfo, open_backend
from .errors import (BackendUnavailableError, CorruptBlockError, StoreConfigError, StoreError,
                     StoreURLError)
from .index import run_gc, scan
from .prefix_store import DEFAULT_BLOCK_SIZE, PrefixStore, PutResult, StoreStats

__all__ = [
    "PrefixStore", "PutResult", "StoreStats", "DEFAULT_BLOCK_SIZE", "open_backend", "ObjectInfo", "scan",
    "run_gc", "StoreError", "StoreURLError", "StoreConfigError", "CorruptBlockError",
    "BackendUnavailableError",
]
