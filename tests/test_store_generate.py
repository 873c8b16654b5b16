"""`rvqstore generate --store URL` as a user runs it: the second run reuses what the first stored."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import python_path

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("The Python interpreter reads a program and executes it one statement at a time. A simple statement "
          "is comprised within a single logical line. Several simple statements may occur on a single line "
          "separated by semicolons. In short, a simple statement is")


def generate(store, *extra):
    env = dict(os.environ, PYTHONPATH=python_path(ROOT))
    return subprocess.run([sys.executable, "-m", "rvqstore", "generate", "--store", str(store), "--prompt", PROMPT,
                           "--max-tokens", "5", *extra], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def test_generate_with_a_store_reuses_the_prefix_next_time(smollm2, tmp_path):
    store = tmp_path / "store"
    first = generate(store)
    assert first.returncode == 0, first.stderr
    m = re.search(r"\[reused (\d+) of (\d+) prompt tokens", first.stderr)
    assert m and m.group(1) == "0"
    total = int(m.group(2))
    assert re.search(rf"\[stored {total + 5} new tokens in \d+ blocks", first.stderr)  # the prompt and the 5 tokens
    second = generate(store)
    assert second.returncode == 0, second.stderr
    assert f"[reused {total - 1} of {total} prompt tokens" in second.stderr
    assert second.stdout == first.stdout  # greedy: the same continuation from the stored prefix
    bad = generate("ftp://nowhere/x")
    assert bad.returncode == 1 and "StoreURLError" in bad.stderr and "Traceback" not in bad.stderr
    both = subprocess.run([sys.executable, "-m", "rvqstore", "generate", "--store", str(store), "--prompt-cache", "x.rvq"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=python_path(ROOT)), timeout=120)
    assert both.returncode == 2 and "not allowed with" in both.stderr
