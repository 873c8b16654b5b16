"""`rvqstore serve`: mlx-lm's own server with its prompt cache backed by a prefix store, end to end
over HTTP on loopback. A restarted server reuses the prefix its predecessor computed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from subprocess_env import python_path

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[1]

REQUEST = {
    "messages": [
        {"role": "system", "content": "You are a concise assistant who knows the Python Language Reference. "
                                      "Answer in one short sentence, without lists or code."},
        {"role": "user", "content": "What does the global statement do?"},
    ],
    "max_tokens": 4,
    "temperature": 0.0,
}


@pytest.fixture(scope="module")
def bundled():
    from rvqstore.errors import ModelNotFoundError
    from rvqstore.model import bundled_model_path

    try:
        return bundled_model_path()
    except ModelNotFoundError as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, store: Path, log: Path):
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=python_path(ROOT))
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rvqstore", "serve", "--store", str(store), "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "INFO"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.time() + 180
        while time.time() < deadline:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return
            except OSError:
                time.sleep(0.3)
        raise AssertionError("server did not come up: " + log.read_text()[-3000:])

    def chat(self) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     data=json.dumps(REQUEST).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def test_a_restarted_server_reuses_the_stored_prefix(bundled, tmp_path):
    store = tmp_path / "store"
    first = Server(store, tmp_path / "first.log")
    try:
        r1 = first.chat()
        n_prompt = r1["usage"]["prompt_tokens"]
        assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing stored yet
        assert r1["choices"][0]["message"]["content"]
        first.chat()  # served after the first one's cache went to the store (one generation thread)
    finally:
        first.stop()
    from rvqstore.store import scan, open_backend

    assert scan(open_backend(str(store))).blocks  # the prefix is on disk
    second = Server(store, tmp_path / "second.log")  # a new process: empty memory
    try:
        r2 = second.chat()
    finally:
        second.stop()
    assert r2["usage"]["prompt_tokens"] == n_prompt
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1  # all but the last token
    assert "prefix store: reusing" in (tmp_path / "second.log").read_text()
