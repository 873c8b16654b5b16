"""A dependency-free progress bar for long prefills and saves (stderr; quiet when not a terminal)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``bar(done, total)`` redraws one line; ``close()`` ends it. Non-terminals get no bar."""

    def __init__(self, label: str, *, stream: TextIO | None = None, enabled: bool | None = None, width: int = 30):
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.width = width
        self.start = time.perf_counter()
        self._drawn = False

    def __call__(self, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        el = time.perf_counter() - self.start
        if total:
            frac = min(1.0, done / total)
            fill = int(frac * self.width)
            bar = "#" * fill + "-" * (self.width - fill)
            msg = f"\r{self.label} [{bar}] {done}/{total} {el:5.1f}s"
        else:
            msg = f"\r{self.label} {done} {el:5.1f}s"
        self.stream.write(msg)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
