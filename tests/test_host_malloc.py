"""rvqstore.host_malloc: glibc's trim threshold raised once per process, switchable, a no-op elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rvqstore import host_malloc
from subprocess_env import python_path

_PROBE = """
import ctypes
from rvqstore import host_malloc
applied = host_malloc.tune()
again = host_malloc.tune()
# what the settings change, seen through mallinfo2's keepcost (the free memory at the top of the heap): freed
# blocks at the top, more than glibc's default trim threshold (128 KB) but less than ours, stay with the process
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Mallinfo2
blocks = [libc.malloc(60_000) for _ in range(200)]  # 12 MB of mid-size blocks: the heap grows
for b in blocks:
    libc.free(b)
print(applied, again, libc.mallinfo2().keepcost)
"""


def _run(env_value):
    env = dict(os.environ, PYTHONPATH=python_path(Path(__file__).resolve().parents[1]))
    env.pop(host_malloc.ENV, None)
    if env_value is not None:
        env[host_malloc.ENV] = env_value
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    applied, again, keep = r.stdout.split()
    return applied == "True", again == "True", int(keep)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is what it tunes")
def test_tuned_heap_keeps_freed_pages_and_the_switch_leaves_glibc_alone():
    applied, again, kept = _run(None)
    assert applied and again
    assert kept >= 10_000_000  # the freed 12 MB stayed at the top of the heap
    applied, again, trimmed = _run("0")
    assert not applied and not again
    assert trimmed < 1_000_000  # glibc's own setting returned it to the OS


def test_tune_is_a_no_op_where_there_is_no_glibc(monkeypatch):
    monkeypatch.setattr(host_malloc, "_state", {})
    monkeypatch.setattr(host_malloc.sys, "platform", "darwin")
    assert host_malloc.tune() is False and host_malloc.tune() is False
