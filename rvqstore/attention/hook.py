"""The mlx-lm hook: packed caches take mlx-lm's attention call.

Every attention layer of mlx-lm's models ends in
``scaled_dot_product_attention(queries, keys, values, cache=cache, scale=..., mask=..., sinks=...)``,
a function of ``mlx_lm.models.base`` that each model module imports by name
(``from .base import scaled_dot_product_attention``; 105 of mlx-lm 0.32's 137 model modules). The
hook wraps that one function: for a cache that can attend on its codes (:func:`handler` finds one) the
call goes to rvqstore, otherwise to mlx-lm's function unchanged. The wrapper replaces the name in
``mlx_lm.models.base`` and in every loaded ``mlx_lm.models.*`` module that bound the original, so
no model code is forked or copied. :func:`install` is idempotent and cheap after the first call; the
caches call it when they are made and on their first update (so modules imported after a cache was
made are caught too). :func:`uninstall` restores mlx-lm's function everywhere.

Keys/values that a model passes are still what the cache's ``update_and_fetch`` returned (in packed
mode a lazily built decode of the codes, never evaluated when the call is served from the codes): a
model that does its own attention math keeps working, at the old speed.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

_lock = threading.Lock()
_original: Callable | None = None
_wrapper: Callable | None = None
_patched: dict[str, Any] = {}  # module name -> module, where the name now points at the wrapper
_seen_modules = 0


def handler(cache: Any) -> Callable | None:
    """The cache's attention-on-codes entry point, if it has one."""
    return getattr(cache, "attend_on_codes", None)


def _passes_its_own_arrays(cache: Any, keys: Any, values: Any) -> bool:
    """Whether the call attends over exactly the keys/values the cache's last update handed out.
    Latent-attention models (DeepSeek V2/V3, Kimi) cache a latent and its rope part, then attend over
    arrays derived from them: those calls must go to mlx-lm's function."""
    fetched = getattr(cache, "_fetched", None)
    return fetched is not None and fetched[0]() is keys and fetched[1]() is values


def _make_wrapper(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        # handler() and _passes_its_own_arrays() written out: this runs once per layer and decode step
        if not _bypass:
            fetched = getattr(cache, "_fetched", None)
            if fetched is not None and fetched[0]() is keys and fetched[1]() is values:
                attend = getattr(cache, "attend_on_codes", None)
                if attend is not None:
                    out = attend(queries, scale=scale, mask=mask, sinks=sinks)
                    if out is not None:  # None: the cache chose decode-then-SDPA for this call
                        return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention.rvqstore_hook = True
    return scaled_dot_product_attention


def _rebind_modules() -> None:
    global _seen_modules
    for name, mod in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and name not in _patched and mod is not None:
            bound = getattr(mod, "scaled_dot_product_attention", None)
            if bound is _original:
                mod.scaled_dot_product_attention = _wrapper
                _patched[name] = mod
            elif bound is _wrapper:  # imported after base was patched: bound the wrapper itself
                _patched[name] = mod
    _seen_modules = len(sys.modules)


def install() -> bool:
    """Route mlx-lm's attention calls through rvqstore's caches. Returns whether mlx-lm is present."""
    global _original, _wrapper
    if _wrapper is not None and len(sys.modules) == _seen_modules:
        return True  # nothing imported since the last scan
    with _lock:
        try:
            from mlx_lm.models import base
        except ImportError:
            return False
        if _wrapper is None:
            current = base.scaled_dot_product_attention
            _original = getattr(current, "__wrapped__", current) if getattr(current, "rvqstore_hook", False) \
                else current
            _wrapper = _make_wrapper(_original)
            base.scaled_dot_product_attention = _wrapper
            _patched["mlx_lm.models.base"] = base
        _rebind_modules()
        return True


def uninstall() -> None:
    """Put mlx-lm's own function back wherever the hook replaced it."""
    global _original, _wrapper, _seen_modules
    with _lock:
        for mod in _patched.values():
            if getattr(mod, "scaled_dot_product_attention", None) is _wrapper:
                mod.scaled_dot_product_attention = _original
        _patched.clear()
        _original = _wrapper = None
        _seen_modules = 0


def installed() -> bool:
    return _wrapper is not None


def hooked(module: Any) -> bool:
    """Whether ``module`` (an mlx-lm model module) now calls through the hook."""
    return getattr(getattr(module, "scaled_dot_product_attention", None), "rvqstore_hook", False)


class bypass:
    """``with hook.bypass():`` calls go to mlx-lm's function (decode-then-SDPA), e.g. as a reference."""

    def __enter__(self):
        global _bypass
        self._prev, _bypass = _bypass, True
        return self

    def __exit__(self, *exc):
        global _bypass
        _bypass = self._prev
        return False


_bypass = False
