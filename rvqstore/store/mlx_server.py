"""mlx-lm's own HTTP server with its prompt cache backed by a prefix store.

mlx-lm's server keeps prompt caches in memory in an ``LRUPromptCache`` (``fetch_nearest_cache``,
``insert_cache``, ``trim_to``). :class:`StorePromptCache` is that class with a second level: a
lookup takes the memory hit when it is at least as long as the store's, else the store's prefix
(decoded into plain mlx-lm ``KVCache`` layers, so batching and every server path work unchanged);
every insert also puts the cache's new blocks in the store. A restarted server, or a second server
on another machine with the same store URL, so reuses prefixes computed before.

:func:`run_server` starts ``mlx_lm.server.main`` itself, after pointing two of its module names at
ours: ``LRUPromptCache`` (the class above) and ``load`` (models through :func:`rvqstore.model.load_model`,
so the bundled GGUF works, in float32 on the CPU). Nothing else of the server is replaced.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from mlx_lm.models.cache import LRUPromptCache

log = logging.getLogger("rvqstore.serve")


def rvq_to_kv_caches(caches: Sequence[Any]) -> list:
    """Decode RVQKVCaches into mlx-lm KVCaches (what the server's batching can merge)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for c in caches:
        k, v = c.keys_and_values()
        kv = KVCache()
        kv.state = (k, v, k.shape[2])
        out.append(kv)
    mx.eval([a for kv in out for a in (kv.keys, kv.values)])
    return out


class StorePromptCache(LRUPromptCache):
    """``LRUPromptCache`` with a prefix store behind it (memory first, then the store).

    ``store_for(model_key)`` returns the :class:`PrefixStore` of a loaded model, or None to serve
    that model from memory only. Store failures are logged and never fail a request.
    """

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63, *,
                 store_for: Callable[[Any], Any], max_store_bytes: int | None = None):
        super().__init__(max_size, max_bytes)
        self._store_for = store_for
        self._max_store_bytes = max_store_bytes
        self._written_since_gc = 0
        self.store_hits = 0
        self.store_tokens = 0

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        in_memory = len(tokens) - len(rest)
        store = self._store_for(model)
        if store is None or len(tokens) < 2 or not all(isinstance(t, int) for t in tokens):
            return cache, rest
        try:
            # leave one token to compute (the model needs it to produce the next logits)
            n, rvq = store.longest_prefix(tokens, max_tokens=len(tokens) - 1, min_tokens=in_memory + 1)
        except Exception as e:  # noqa: BLE001 - the store is an accelerator, never a failure
            log.warning("prefix store lookup failed: %s: %s", type(e).__name__, e)
            return cache, rest
        if rvq is None:
            return cache, rest
        self.store_hits += 1
        self.store_tokens += n
        log.info("prefix store: reusing %d of %d prompt tokens (memory had %d)", n, len(tokens), in_memory)
        return rvq_to_kv_caches(rvq), tokens[n:]

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *, cache_type: str = "assistant"):
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        store = self._store_for(model)
        if store is None or not all(isinstance(t, int) for t in tokens):
            return
        try:
            r = store.put(tokens, prompt_cache)
            self._written_since_gc += r.new_bytes
            if r.new_blocks:
                log.info("prefix store: stored %d new tokens in %d blocks (%d bytes)", r.new_tokens, r.new_blocks,
                         r.new_bytes)
            budget = self._max_store_bytes
            if budget is not None and self._written_since_gc > max(1, budget // 10):
                store.gc(budget)
                self._written_since_gc = 0
        except Exception as e:  # noqa: BLE001
            log.warning("prefix store put failed: %s: %s", type(e).__name__, e)


class _Models:
    """Models loaded by the server (by the path mlx-lm names them with) and their stores."""

    def __init__(self, url: str, store_options: dict):
        self.url = url
        self.options = store_options
        self._stores: dict[str, Any] = {}
        self._lock = threading.Lock()

    def add(self, path: str, model: Any, tokenizer: Any) -> None:
        from .prefix_store import PrefixStore

        try:
            store = PrefixStore(self.url, model=model, tokenizer=tokenizer, **self.options)
        except Exception as e:  # noqa: BLE001 - the server still serves, from memory only
            log.warning("prefix store %s unavailable for %s: %s", self.url, path, e)
            store = None
        with self._lock:
            self._stores[str(path)] = store

    def store_for(self, model_key: Any):
        # mlx-lm's key is (model path, adapter path, draft model path); adapters and draft models
        # change what a cache holds, so those are served from memory only
        if not isinstance(model_key, tuple) or len(model_key) != 3 or model_key[1] or model_key[2]:
            return None
        with self._lock:
            return self._stores.get(str(model_key[0]))


def _make_loader(models: _Models, original_load: Callable):
    def load(path, adapter_path=None, tokenizer_config=None, return_config=False, **kwargs):
        from ..model import load_model

        if adapter_path is not None:  # adapters: mlx-lm's own loader, memory-only cache
            return original_load(path, adapter_path=adapter_path, tokenizer_config=tokenizer_config,
                                 return_config=return_config, **kwargs)
        model, tokenizer = load_model(path)
        models.add(str(path), model, tokenizer)
        if not return_config:
            return model, tokenizer
        cfg_file = Path(path) / "config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {"model_type": model.args.model_type}
        return model, tokenizer, config

    return load


def run_server(store_url: str, server_argv: list[str], *, store_options: dict | None = None,
               max_store_bytes: int | None = None) -> None:
    """Run ``mlx_lm.server.main()`` with ``server_argv`` (its own options) and the store-backed cache.
    Without ``--model`` the bundled SmolLM2 is served."""
    import mlx_lm.server as server

    from ..model import bundled_model_path

    if "--model" not in server_argv and not any(a.startswith("--model=") for a in server_argv):
        server_argv = ["--model", str(bundled_model_path())] + list(server_argv)
    models = _Models(store_url, dict(store_options or {}))
    server.load = _make_loader(models, server.load)

    def cache_factory(max_size: int = 10, max_bytes: int = 1 << 63):
        return StorePromptCache(max_size, max_bytes, store_for=models.store_for, max_store_bytes=max_store_bytes)

    server.LRUPromptCache = cache_factory
    argv0 = sys.argv
    sys.argv = ["rvqstore serve"] + list(server_argv)
    try:
        server.main()
    finally:
        sys.argv = argv0
