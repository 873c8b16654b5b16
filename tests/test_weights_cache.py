"""The per-machine record of weight hashes: a process without a memo takes ``weights_sha256`` from it
instead of hashing every weight; an edited model never gets an old hash; damaged records are ignored and
rewritten; ``off`` keeps nothing. Tiny random-weight mlx-lm models, real files, real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import rvqstore.fingerprint as fpmod
from rvqstore import load_prompt_cache, make_prompt_cache, model_check, save_prompt_cache, weights_cache
from rvqstore.errors import ModelMismatchError
from rvqstore.generation import prefill

sys.path.insert(0, str(Path(__file__).parent))
from subprocess_env import python_path  # noqa: E402
from tiny_models import build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOKENS = list(range(3, 15))


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "weights"
    monkeypatch.setenv(weights_cache.ENV, str(d))
    model_check._FP_MEMO.clear()  # each test starts as a fresh process does
    yield d
    model_check._FP_MEMO.clear()


@pytest.fixture()
def hashes(monkeypatch):
    """Counts the full weight hashes computed."""
    calls = []
    real = fpmod._weights_sha256

    def counted(model):
        calls.append(model)
        return real(model)

    monkeypatch.setattr(fpmod, "_weights_sha256", counted)
    return calls


def _records(d: Path) -> list[Path]:
    return sorted(d.glob("*.json")) if d.is_dir() else []


def test_a_fresh_memo_takes_the_kept_hash(cache_dir, hashes):
    model = build("llama")[0]
    first = model_check.fingerprint(model, None)
    assert len(hashes) == 1 and len(_records(cache_dir)) == 1
    model_check._FP_MEMO.clear()
    assert model_check.fingerprint(model, None) == first
    assert len(hashes) == 1  # read back, not recomputed
    other = build("llama", seed=1)[0]  # the same geometry, other weights: its own hash
    assert model_check.fingerprint(other, None)["weights_sha256"] != first["weights_sha256"]
    assert len(hashes) == 2 and len(_records(cache_dir)) == 2


def test_an_edited_model_is_refused_even_with_a_record_for_its_old_weights(cache_dir, hashes, tmp_path):
    model = build("llama")[0]
    cache = make_prompt_cache(model, bits=(2, 2))
    prefill(model, TOKENS, cache)
    path = tmp_path / "s.rvq"
    save_prompt_cache(path, cache, tokens=TOKENS, model=model)
    model_check._FP_MEMO.clear()
    w = model.model.norm.weight
    w[0] += 1.0  # in place
    mx.eval(w)
    with pytest.raises(ModelMismatchError, match="weights_sha256"):
        load_prompt_cache(path, model=model)
    assert len(hashes) == 2  # the edited weights were hashed themselves


def test_another_process_reads_the_record(cache_dir):
    code = ("import json, sys; sys.path.insert(0, 'tests'); from tiny_models import build; "
            "import rvqstore.fingerprint as f; real = f._weights_sha256; n = []; "
            "f._weights_sha256 = lambda m: n.append(1) or real(m); "
            "from rvqstore.model_check import fingerprint; fp = fingerprint(build('llama')[0], None); "
            "print(json.dumps([fp, len(n)]))")
    env = {**os.environ, "PYTHONPATH": python_path(REPO), weights_cache.ENV: str(cache_dir)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0][1] == 1 and runs[1][1] == 0  # the second process hashed nothing
    assert runs[0][0] == runs[1][0]
    assert runs[0][0] == model_check.fingerprint(build("llama")[0], None)


@pytest.mark.parametrize("damage", ["garbage", "other key", "bad hash", "huge", "not a map"])
def test_a_damaged_record_is_ignored_and_rewritten(cache_dir, hashes, damage):
    model = build("llama")[0]
    good = model_check.fingerprint(model, None)
    (record,) = _records(cache_dir)
    body = json.loads(record.read_text())
    record.write_bytes({"garbage": b"\x00\xffnot json",
                        "other key": json.dumps({**body, "key": "0" * 64}).encode(),
                        "bad hash": json.dumps({**body, "weights_sha256": "f" * 63}).encode(),
                        "huge": json.dumps({**body, "pad": "x" * 5000}).encode(),
                        "not a map": b"[1, 2]"}[damage])
    model_check._FP_MEMO.clear()
    assert model_check.fingerprint(model, None) == good
    assert len(hashes) == 2  # recomputed
    assert json.loads(record.read_text()) == body  # and kept again


def test_records_are_private(cache_dir):
    """A record vouches for a model, so only its user may write it."""
    model = build("llama")[0]
    model_check.fingerprint(model, None)
    (record,) = _records(cache_dir)
    assert record.stat().st_mode & 0o077 == 0  # private: written through mkstemp


def test_another_mlx_version_does_not_read_the_record(cache_dir, hashes, monkeypatch):
    model = build("llama")[0]
    model_check.fingerprint(model, None)
    model_check._FP_MEMO.clear()
    monkeypatch.setattr(weights_cache.mx, "__version__", "0.0.0-other")
    model_check.fingerprint(model, None)
    assert len(hashes) == 2 and len(_records(cache_dir)) == 2


def test_off_keeps_nothing(tmp_path, monkeypatch, hashes):
    monkeypatch.setenv(weights_cache.ENV, "off")
    monkeypatch.setenv("HOME", str(tmp_path))  # the default place would be under it
    model_check._FP_MEMO.clear()
    model = build("llama")[0]
    fp = model_check.fingerprint(model, None)
    model_check._FP_MEMO.clear()
    assert model_check.fingerprint(model, None) == fp
    assert len(hashes) == 2 and not any(tmp_path.rglob("*.json"))


def test_a_disk_that_refuses_the_record_changes_nothing_else(tmp_path, monkeypatch, hashes):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(weights_cache.ENV, str(blocker / "weights"))
    model_check._FP_MEMO.clear()
    model = build("llama")[0]
    fp = model_check.fingerprint(model, None)
    assert len(hashes) == 1 and fp == fpmod.model_fingerprint(model, None)
    assert blocker.read_text() == "not a directory"
