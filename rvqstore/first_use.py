"""Kernels that stand in for an MLX-ops path: checked at first use, latched off when they fail.

The first call of each configuration runs the kernel and compares its result with the path it replaces;
a kernel that cannot build, run or agree is switched off for that configuration (logged once) and the
caller takes its other path. Each kernel module keeps its own ``verified`` set, ``disabled`` map and
lock (its ``disabled()`` reports them); :func:`serve` is the one place the rule is written.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger("rvqstore.kernels")


def serve(config: Any, launch: Callable[[], Any], check: Callable[[Any], str | None], *, verified: set,
          disabled: dict, lock: threading.Lock, what: str) -> Any | None:
    """``launch()``, or None when ``config`` is latched off or fails now. On the first use of ``config``,
    ``check(out)`` returns None when ``out`` agrees with the replaced path, else why not."""
    if config in disabled:
        return None
    try:
        out = launch()
        if config not in verified:
            why = check(out)
            if why is not None:
                raise RuntimeError(f"first-use check failed: {why}")
            with lock:
                verified.add(config)
        return out
    except Exception as err:  # cannot build, run or agree: latch off, say so once
        with lock:
            disabled[config] = f"{type(err).__name__}: {err}"
        log.warning("%s switched off for %s: %s", what, config, err)
        return None
