"""Prefill, cache a prompt to ``.rvq``, and continue generating from a snapshot."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

from .codec import DEFAULT_BITS
from .prompt_cache import make_prompt_cache, save_prompt_cache

ProgressFn = Callable[[int, "int | None"], None]


def prefill(model: Any, tokens: Sequence[int], cache: list, *, chunk: int = 512,
            progress: ProgressFn | None = None) -> mx.array:
    """Run ``tokens`` through ``model`` into ``cache`` in chunks; return the last position's logits."""
    if not len(tokens):
        raise ValueError("nothing to prefill: no tokens")
    ids = mx.array(list(tokens), dtype=mx.int32)[None]
    n = ids.shape[1]
    logits = None
    for start in range(0, n, chunk):
        logits = model(ids[:, start:start + chunk], cache=cache)
        logits = logits[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        if progress is not None:
            progress(min(n, start + chunk), n)
    return logits


@dataclass
class CachedPrompt:
    path: str
    n_tokens: int
    file_bytes: int
    prefill_s: float
    save_s: float


def cache_prompt(model: Any, tokenizer: Any, tokens: Sequence[int], path: str | os.PathLike, *,
                 bits: tuple[int, int] = DEFAULT_BITS, seed: int = 0, residual: str = "conditional",
                 mode: str = "packed", dense_window: int = 0, metadata: dict[str, str] | None = None,
                 chunk: int = 512, progress: ProgressFn | None = None,
                 save_progress: ProgressFn | None = None) -> CachedPrompt:
    """Prefill ``tokens`` into RVQ caches and save them (with the token ids and the model fingerprint)."""
    cache = make_prompt_cache(model, bits, seed, residual, mode=mode, dense_window=dense_window)
    t0 = time.perf_counter()
    prefill(model, tokens, cache, chunk=chunk, progress=progress)
    t1 = time.perf_counter()
    size = save_prompt_cache(path, cache, tokens=tokens, metadata=metadata, model=model, tokenizer=tokenizer,
                             progress=save_progress)
    return CachedPrompt(os.fspath(path), len(tokens), size, t1 - t0, time.perf_counter() - t1)


def greedy_tokens(model: Any, cache: list, tokens: Sequence[int], max_tokens: int, *,
                  eos: Sequence[int] = (), chunk: int = 512) -> Iterator[int]:
    """Feed ``tokens`` (the part of the prompt not in ``cache``), then yield greedy tokens."""
    logits = prefill(model, tokens, cache, chunk=chunk)
    for _ in range(max_tokens):
        y = int(mx.argmax(logits, axis=-1).item())
        yield y
        if y in eos:
            return
        logits = model(mx.array([[y]], dtype=mx.int32), cache=cache)[:, -1, :]
