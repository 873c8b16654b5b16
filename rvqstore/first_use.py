"""Kernels that stand in for an MLX-ops path: checked at first use, latched off when they fail.

The first call of each configuration runs the kernel and compares its result with the path it replaces;
a kernel that cannot build, run or agree is switched off for that configuration (logged once) and the
caller takes its other path. A verdict on kernels launched from rvqstore's kernel cache is kept per
machine (a later process skips the comparison, which builds the replaced path too). Each kernel module
keeps its own ``verified`` set, ``disabled`` map and lock (its ``disabled()`` reports them); :func:`serve`
is the one place the rule is written.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import mlx.core as mx

from . import kernel_cache

log = logging.getLogger("rvqstore.kernels")


def serve(config: Any, launch: Callable[[], Any], check: Callable[[Any], str | None], *, verified: set,
          disabled: dict, lock: threading.Lock, what: str) -> Any | None:
    """``launch()``, or None when ``config`` is latched off or fails now. On the first use of ``config``,
    ``check(out)`` returns None when ``out`` agrees with the replaced path, else why not.

    Where ``launch()`` ran kernels from rvqstore's kernel cache (:mod:`rvqstore.kernel_cache`), the
    verdict is kept per machine for those binaries: a later process only evaluates ``out`` once instead
    of checking it, and a configuration that failed its check there stays off."""
    if config in disabled:
        return None
    try:
        first = config not in verified
        if first:
            kernel_cache.begin_launch_log()
        out = launch()
        if first:
            vkey = kernel_cache.verdict_key(what, config, kernel_cache.launched_binaries())
            kept = kernel_cache.verdict(vkey)
            if isinstance(kept, str):
                raise RuntimeError(f"first-use check failed on this machine before: {kept}")
            if kept is True:  # checked on this machine before: build and run it now, where we can fall back
                mx.eval(out)
            else:
                why = check(out)
                if why is not None:
                    kernel_cache.record_verdict(vkey, False, why)
                    raise RuntimeError(f"first-use check failed: {why}")
                kernel_cache.record_verdict(vkey, True)
            with lock:
                verified.add(config)
        return out
    except Exception as err:  # cannot build, run or agree: latch off, say so once
        with lock:
            disabled[config] = f"{type(err).__name__}: {err}"
        log.warning("%s switched off for %s: %s", what, config, err)
        return None
