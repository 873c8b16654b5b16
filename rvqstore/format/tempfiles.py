"""Temporary files of saves in progress, and the sweep of those that killed saves left behind.

A writer creates ``.NAME.<pid>.<random>.tmp`` beside the target and holds an exclusive ``flock`` on
it until it has renamed it into place.  The kernel drops the lock when the writer dies, however it
dies, so "unlocked" means "no live writer": the sweep removes exactly the temporaries it can lock
(and that are older than a few seconds, which covers the instant between a writer's ``open`` and its
``flock``).  The pid in the name is for people reading a directory listing, not for the decision.
"""

from __future__ import annotations

import os
import re
import time

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no sweep, temps are left for the user
    fcntl = None  # type: ignore[assignment]

#: A temporary younger than this is never swept (its writer may not have locked it yet).
MIN_AGE_S = 10.0


def temp_name(target: str, token: str) -> str:
    d, base = os.path.split(target)
    return os.path.join(d, f".{base}.{os.getpid()}.{token}.tmp")


def lock_temp(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _candidates(target: str):
    d, base = os.path.split(target)
    pat = re.compile(r"\." + re.escape(base) + r"\.(?:[0-9]+\.)?[0-9a-f]{12}\.tmp\Z")
    try:
        names = os.listdir(d or ".")
    except OSError:
        return
    for n in names:
        if pat.match(n):
            yield os.path.join(d, n)


def sweep_stale_temps(target: "str | os.PathLike[str]", *, min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove the temporaries of ``target`` that no live writer holds; return the paths removed."""
    if fcntl is None:
        return []
    removed = []
    now = time.time()
    for p in _candidates(os.fspath(target)):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue  # gone already, or a symlink: not ours
        try:
            st = os.fstat(fd)
            if not os.path.stat.S_ISREG(st.st_mode) or now - st.st_mtime < min_age_s:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live writer holds it
            try:
                same = os.lstat(p)
            except FileNotFoundError:
                continue  # its writer renamed it into place meanwhile
            if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(p)
                removed.append(p)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed
