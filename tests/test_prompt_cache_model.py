"""Save / load / resume on the real bundled model (SmolLM2-135M-Instruct, short prompts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rvqstore
from rvqstore import ModelMismatchError, load_prompt_cache, make_prompt_cache, resume, save_prompt_cache
from rvqstore.format import ChecksumMismatchError, FormatError, TruncatedFileError
from rvqstore.generation import greedy_tokens, prefill
from subprocess_env import python_path

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[1]
PREFIX, SUFFIX_A, SUFFIX_B = 64, 16, 12


@pytest.fixture(scope="module")
def saved(smollm2, sample_tokens, tmp_path_factory):
    """A 2+2 RVQ cache of PREFIX + SUFFIX_A tokens, saved with tokens and fingerprint."""
    model, tok = smollm2
    tokens = sample_tokens[: PREFIX + SUFFIX_A]
    cache = make_prompt_cache(model)
    prefill(model, tokens, cache)
    path = tmp_path_factory.mktemp("rvq") / "prompt.rvq"
    save_prompt_cache(path, cache, tokens=tokens, model=model, tokenizer=tok, metadata={"case": "test"})
    return path, tokens, cache


def _logits(model, cache, tokens):
    out = model(mx.array([tokens], dtype=mx.int32), cache=cache)
    mx.eval(out)
    return np.array(out[0].astype(mx.float32))


_FRESH = """
import json, sys
from rvqstore.model import load_model
from rvqstore import load_prompt_cache
from rvqstore.generation import greedy_tokens
model, tok = load_model()
cache = load_prompt_cache(sys.argv[1], model=model, tokenizer=tok)
print(json.dumps(list(greedy_tokens(model, cache, json.loads(sys.argv[2]), 12))))
"""


def test_greedy_continuation_in_fresh_process_is_token_identical(smollm2, saved, sample_tokens):
    model, _ = smollm2
    path, tokens, _ = saved
    cont = sample_tokens[PREFIX + SUFFIX_A: PREFIX + SUFFIX_A + 3]
    here = list(greedy_tokens(model, load_prompt_cache(path), cont, 12))
    # the saving process's own cache object, continued
    model_cache = make_prompt_cache(model)
    prefill(model, tokens, model_cache)
    same_process = list(greedy_tokens(model, model_cache, cont, 12))
    env = dict(os.environ, PYTHONPATH=python_path(ROOT))
    out = subprocess.run([sys.executable, "-c", _FRESH, str(path), json.dumps(cont)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    assert fresh == same_process == here
    assert len(fresh) == 12


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_loaded_cache_reproduces_saved_one_bit_for_bit(saved, mode):
    path, tokens, cache = saved
    loaded, meta = load_prompt_cache(path, return_metadata=True, mode=mode)
    assert meta == {"case": "test"} and len(loaded) == len(cache)
    for a, b in zip(cache, loaded):
        assert b.offset == len(tokens) and b.mode == mode
        for x, y in zip(a.state, b.state):
            if x is None:
                assert y is None
                continue
            assert x.dtype == y.dtype and x.shape == y.shape
            assert mx.array_equal(x, y).item()
        ka, va = a.keys_and_values()
        kb, vb = b.keys_and_values()
        assert mx.array_equal(ka, kb).item() and mx.array_equal(va, vb).item()


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_resume_shared_prefix_gives_the_logits_of_the_in_memory_cache(smollm2, saved, sample_tokens, mode, tmp_path):
    model, tok = smollm2
    path, tokens, _ = saved
    # in memory: the same prompt's cache in the same mode, trimmed to the prefix without going through a file
    mem = make_prompt_cache(model, mode=mode)
    prefill(model, tokens, mem)
    if mode != "packed":
        # the fixture's file comes from a packed prefill, whose attention reads the codes; a resident prefill's
        # reads its decoded copy: float32 sums in another order, so some later layers' keys round differently
        path = tmp_path / "resident.rvq"
        save_prompt_cache(path, mem, tokens=tokens, model=model, tokenizer=tok)
    other = sample_tokens[PREFIX + 200: PREFIX + 200 + SUFFIX_B]  # a different suffix
    prompt = tokens[:PREFIX] + other
    r = resume(path, prompt, model, tokenizer=tok, mode=mode)
    assert (r.reused, r.remaining, r.stored) == (PREFIX, other, PREFIX + SUFFIX_A)
    assert all(c.offset == PREFIX for c in r.cache)
    got = _logits(model, r.cache, r.remaining)
    for c in mem:
        c.trim(SUFFIX_A)
    np.testing.assert_array_equal(got, _logits(model, mem, other))
    # A cache that only ever saw the prefix is close but not bit-identical: a forward over 64 tokens
    # rounds some keys differently from one over 80, and a value that close to a boundary can flip
    # its code (measured: 0 flipped words at 2+2, ~1,000 of 200k at 4+2 on this text).
    fresh = make_prompt_cache(model, mode=mode)
    prefill(model, tokens[:PREFIX], fresh)
    ref = _logits(model, fresh, other)
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.75
    assert np.mean(np.abs(got - ref)) < 0.1 * np.mean(np.abs(ref - ref.mean(-1, keepdims=True)))


def test_resume_of_the_whole_prompt_recomputes_only_its_last_token(smollm2, saved):
    model, tok = smollm2
    path, tokens, _ = saved
    r = resume(path, tokens, model, tokenizer=tok)
    assert r.reused == len(tokens) - 1 and r.remaining == tokens[-1:]


def test_wrong_model_is_refused(smollm2, saved):
    model, tok = smollm2
    path, tokens, _ = saved
    w = model.model.norm.weight
    model.model.norm.weight = w * 1.001  # same architecture and geometry, other weights
    try:
        with pytest.raises(ModelMismatchError, match="weights_sha256"):
            load_prompt_cache(path, model=model, tokenizer=tok)
        with pytest.raises(ModelMismatchError):
            resume(path, tokens, model, tokenizer=tok)
    finally:
        model.model.norm.weight = w
    assert len(load_prompt_cache(path, model=model, tokenizer=tok)) == len(model.layers)


def test_corrupted_and_truncated_files_raise_typed_errors(saved, tmp_path):
    path, _, _ = saved
    data = bytearray(path.read_bytes())
    with rvqstore.open(path) as f:
        sec = f.section("layers.3.keys.codes1")
    flipped = tmp_path / "flipped.rvq"
    data[sec.offset + 5] ^= 0x10
    flipped.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError):
        load_prompt_cache(flipped)
    cut = tmp_path / "cut.rvq"
    cut.write_bytes(path.read_bytes()[: sec.offset + 10])
    with pytest.raises(TruncatedFileError):
        load_prompt_cache(cut)
    assert issubclass(ChecksumMismatchError, FormatError) and issubclass(FormatError, rvqstore.RVQError)


def test_nbytes_and_snapshot_accounting_agree(saved):
    path, tokens, cache = saved
    with rvqstore.open(path) as f:
        raw = sum(s.raw_length for s in f.sections if s.layer >= 0)
        assert f.n_tokens == len(tokens)
    assert raw == sum(c.packed_nbytes for c in cache)
    loaded = load_prompt_cache(path)  # exact-size arrays: bytes held == bytes stored (uncompressed)
    assert sum(c.nbytes for c in loaded) == raw
    held = sum(sum(a.nbytes for a in c.state if a is not None) for c in loaded)
    assert held == raw


def test_failed_save_leaves_the_good_file_untouched(smollm2, saved, tmp_path):
    model, _ = smollm2
    path, tokens, cache = saved
    target = tmp_path / "keep.rvq"
    save_prompt_cache(target, cache, tokens=tokens)
    before = target.read_bytes()
    with pytest.raises(ValueError):
        save_prompt_cache(target, cache, tokens=tokens[:-1])  # wrong token count: refused
    broken = make_prompt_cache(model)
    prefill(model, tokens[:8], broken)
    broken[5].trim(1)  # layers disagree: refused before anything is written
    with pytest.raises(rvqstore.RVQError):
        save_prompt_cache(target, broken)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["keep.rvq"]


def test_mlx_lm_stream_generate_runs_on_the_rvq_cache(smollm2, sample_tokens):
    from mlx_lm import stream_generate

    model, tok = smollm2
    cache = make_prompt_cache(model, mode="resident")
    prompt = sample_tokens[:40]
    out = list(stream_generate(model, tok, prompt=prompt, max_tokens=5, prompt_cache=cache))
    assert out[-1].generation_tokens == 5
    from mlx_lm.models.cache import make_prompt_cache as lm_make

    ref = lm_make(model)
    list(stream_generate(model, tok, prompt=prompt, max_tokens=5, prompt_cache=ref))
    assert cache[0].offset == ref[0].offset > 40  # the same protocol calls as mlx-lm's own KVCache
    assert not hasattr(cache[0], "bits")
