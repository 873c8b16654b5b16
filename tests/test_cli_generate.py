"""The model commands of the CLI, run as a user would (subprocesses, the bundled model)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from subprocess_env import python_path

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[1]


def cli(*args, stdin=None):
    env = dict(os.environ, PYTHONPATH=python_path(ROOT))
    return subprocess.run([sys.executable, "-m", "rvqstore", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, input=stdin, timeout=300)


def test_cache_prompt_then_generate_resumes_the_prefix(smollm2, tmp_path):
    out = tmp_path / "p.rvq"
    r = cli("cache-prompt", "--prompt-file", "-", "-o", out, "--bits", "2+2",
            stdin="The Python interpreter reads a program and executes it, one statement at a time.")
    assert r.returncode == 0, r.stderr
    assert out.exists() and "cached" in r.stdout
    g = cli("generate", "--prompt-cache", out, "--prompt", " In other words,", "--max-tokens", "6")
    assert g.returncode == 0, g.stderr
    assert "[reused " in g.stderr and "Traceback" not in g.stderr
    reused, total = g.stderr.split("[reused ")[1].split(" prompt tokens")[0].split(" of ")
    assert int(reused) >= 10 and int(total) > int(reused)
    assert g.stdout.strip()  # some generated text


@pytest.mark.parametrize("args,code,needle", [
    (("cache-prompt", "--prompt", "hi", "-o", "x.rvq", "--bits", "9+9"), 1, "CodecConfigError"),
    (("cache-prompt", "--prompt", "hi", "-o", "x.rvq", "--bits", "x"), 2, "--bits"),
    (("cache-prompt", "-o", "x.rvq"), 2, "a prompt is needed"),
    (("generate", "--prompt-cache", "/nonexistent/p.rvq"), 1, "No such file"),
])
def test_bad_arguments_give_one_line_and_a_status(args, code, needle):
    r = cli(*args)
    assert r.returncode == code
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 or code == 2
