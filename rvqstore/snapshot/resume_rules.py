"""How far back each cache kind can be rewound, and the longest prefix every layer can resume at.

- ``RVQKVCache``: any prefix (codes are per token).
- ``RVQRotatingKVCache``: back to :meth:`~rvqstore.rotating_cache.RVQRotatingKVCache.trimmable_to`:
  once tokens have left the window, the window must still hold everything the next token attends to.
- ``ArraysCache`` (recurrent state): only at exactly the length it holds (a state cannot be unrolled).
- ``CacheList``: what all its children allow.

Each layer allows ``{0} | [lowest, held]``; so does their intersection, hence one number per layer.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..cache import RVQKVCache
from ..rotating_cache import RVQRotatingKVCache


def _lm():
    from mlx_lm.models import cache as lm

    return lm


def lowest_resume_point(c: Any, n_tokens: int) -> tuple[int, str]:
    """(smallest nonzero prefix this cache can be cut back to, why) for a cache holding ``n_tokens``."""
    lm = _lm()
    if isinstance(c, RVQKVCache):
        return 0, ""
    if isinstance(c, RVQRotatingKVCache):
        lo = c.trimmable_to()
        return lo, (f"a sliding window of {c.max_size} tokens that has moved past the start and cannot rewind below "
                    f"{lo} tokens") if lo else ""
    if isinstance(c, lm.ArraysCache):
        return n_tokens, f"a recurrent state, reusable only at its exact length ({n_tokens} tokens)"
    if isinstance(c, lm.CacheList):
        return max((lowest_resume_point(x, n_tokens) for x in c.caches), key=lambda t: t[0])
    raise TypeError(f"unexpected cache {type(c).__name__}")


def longest_valid_prefix(caches: Sequence[Any], wanted: int, n_tokens: int) -> tuple[int, str]:
    """The longest prefix <= ``wanted`` every layer can resume at, and a reason when it is not ``wanted``."""
    for i, c in enumerate(caches):
        lo, why = lowest_resume_point(c, n_tokens)
        if 0 < wanted < lo:
            return 0, (f"layer {i} ({type(c).__name__}) holds {why}; the prompt shares {wanted} of the {n_tokens} "
                       f"stored tokens (at least one must be computed), so nothing is reused")
    return wanted, ""


def empty_like(c: Any) -> Any:
    """A fresh cache of the same kind and settings."""
    lm = _lm()
    if isinstance(c, RVQKVCache):
        return RVQKVCache(c.codec_bits, c.seed, c.residual, mode=c.mode, dense_window=c.dense_window,
                          flush_block=c.flush_block, use_kernels=c.use_kernels, value_bits=c.value_bits,
                          step=c.step, value_step=c.value_step, sink_tokens=c.sink_tokens, center_keys=c.center_keys)
    if isinstance(c, RVQRotatingKVCache):
        return RVQRotatingKVCache(c.max_size, c.keep, c.codec_bits, c.seed, c.residual, mode=c.mode,
                                  use_kernels=c.use_kernels, step=c.step)
    if isinstance(c, lm.ArraysCache):
        return lm.ArraysCache(len(c.cache))
    if isinstance(c, lm.CacheList):
        return lm.CacheList(*(empty_like(x) for x in c.caches))
    raise TypeError(f"unexpected cache {type(c).__name__}")


def cut_to(caches: Sequence[Any], p: int) -> list:
    """``caches`` rewound to ``p`` tokens (a valid point from :func:`longest_valid_prefix`)."""
    if p == 0:
        return [empty_like(c) for c in caches]
    out = []
    for c in caches:
        if isinstance(c, (RVQKVCache, RVQRotatingKVCache)):
            c.trim(c.offset - p)
        elif isinstance(c, _lm().CacheList):
            cut_to(c.caches, p)
        out.append(c)
    return out
