"""Every cache kind on real (tiny, random-weight) mlx-lm models of several architectures.

llama, qwen3 (plain KV), gemma3_text and gpt_oss (sliding window + full layers; gpt_oss with attention
sinks), qwen3_next (recurrent state + full attention), falcon_h1 (a CacheList of recurrent state and
KV per layer), deepseek_v3 (latent attention: key and value head dims differ). Prompts of 8 and 40 tokens sit on both sides of the 16-token window.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_prompt_cache

import rvqstore
from rvqstore.generation import prefill
from rvqstore.rotating_cache import RVQRotatingKVCache
from subprocess_env import python_path

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import CONFIGS, WINDOW, build, prompt_tokens, step_logits, write_model_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARCHS = list(CONFIGS)
LENGTHS = (8, 40)  # shorter and longer than the window
MORE = [9, 10, 11, 12]


@pytest.fixture(scope="module")
def models():
    return {arch: build(arch)[0] for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_rvq_4_4_logits_are_close_to_the_unquantized_caches(models, arch):
    model = models[arch]
    for n in LENGTHS:
        ref_cache, cache = mlx_lm_prompt_cache(model), rvqstore.make_prompt_cache(model, bits=(4, 4))
        ref = step_logits(model, ref_cache, prompt_tokens(n) + MORE)
        got = step_logits(model, cache, prompt_tokens(n) + MORE)
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        # measured 0.003-0.008, gemma3_text 0.037-0.050 (its 2+2 error: 0.43-0.54)
        assert rel < 0.07, (arch, n, rel)
        assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.75
        for c in cache:
            if isinstance(c, RVQRotatingKVCache):  # the window, never more, as codes
                assert c.n_held <= WINDOW and c.offset == n + len(MORE)
    kinds = {type(c).__name__ for c in cache}
    expect = {"gemma3_text": {"RVQRotatingKVCache", "RVQKVCache"}, "gpt_oss": {"RVQRotatingKVCache", "RVQKVCache"},
              "qwen3_next": {"ArraysCache", "RVQKVCache"}, "falcon_h1": {"CacheList"}}.get(arch, {"RVQKVCache"})
    assert kinds == expect


_FRESH = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import mlx.core as mx, numpy as np
import rvqstore
from rvqstore.generation import prefill
from tiny_models import build
jobs = json.loads(sys.argv[1])
out = {}
for job in jobs:
    model, _ = build(job["arch"])
    model.load_weights(job["weights"])
    r = rvqstore.resume(job["path"], job["prompt"], model)
    logits = prefill(model, r.remaining, r.cache)
    for t in job["steps"]:
        logits = model(mx.array([[t]]), cache=r.cache)[:, -1, :]
    np.save(job["out"], np.array(logits))
    out[job["out"]] = [r.reused, r.reason]
print(json.dumps(out))
"""


def test_save_load_resume_in_a_fresh_process_is_exact(models, tmp_path):
    """Snapshots of every architecture, resumed in another process: exactly the in-memory logits."""
    jobs, expected = [], {}
    for arch in ARCHS:
        model = models[arch]
        weights = str(tmp_path / f"{arch}.safetensors")
        model.save_weights(weights)
        for n in LENGTHS:
            tokens = prompt_tokens(n)
            cache = rvqstore.make_prompt_cache(model, bits=(2, 2))
            prefill(model, tokens, cache)
            path = tmp_path / f"{arch}-{n}.rvq"
            rvqstore.save_prompt_cache(path, cache, tokens=tokens, model=model)
            # 1) the prompt goes on: every stored token is reused
            loaded = rvqstore.load_prompt_cache(path, model=model)
            mem = prefill(model, MORE[:2], loaded)
            for t in MORE[2:]:
                mem = model(mx.array([[t]]), cache=loaded)[:, -1, :]
            key = str(tmp_path / f"{arch}-{n}-on.npy")
            jobs.append(dict(arch=arch, weights=weights, path=str(path), prompt=tokens + MORE[:2], steps=MORE[2:], out=key))
            expected[key] = (np.array(mem), n)
            # 2) the prompt differs in its last stored token: sliding windows rewind one token, recurrent
            #    state cannot (nothing reused), plain layers any amount
            other = tokens[:-1] + [5, 6]
            recurrent = any(isinstance(x, ArraysCache) for c in cache for x in getattr(c, "caches", [c]))
            mem_cache = rvqstore.make_prompt_cache(model, bits=(2, 2))
            if recurrent:
                mem = prefill(model, other, mem_cache)
            else:
                prefill(model, tokens, mem_cache)
                for c in mem_cache:
                    assert c.trim(1) == 1
                mem = prefill(model, other[n - 1:], mem_cache)
            key = str(tmp_path / f"{arch}-{n}-diff.npy")
            jobs.append(dict(arch=arch, weights=weights, path=str(path), prompt=other, steps=[], out=key))
            expected[key] = (np.array(mem), 0 if recurrent else n - 1)
    env = dict(os.environ, PYTHONPATH=python_path(ROOT))
    res = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(jobs), str(Path(__file__).parent)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    reused = json.loads(res.stdout.strip().splitlines()[-1])
    for key, (mem, want_reused) in expected.items():
        assert reused[key][0] == want_reused, (key, reused[key])
        np.testing.assert_array_equal(np.load(key), mem, err_msg=key)
    assert any("recurrent state" in why for _, why in reused.values())


def test_snapshot_layer_kinds_in_the_file(models, tmp_path):
    expect = {"gemma3_text": ["rvq-rotating", "rvq-rotating", "rvq"], "gpt_oss": ["rvq-rotating", "rvq"],
              "qwen3_next": ["arrays", "rvq", "arrays", "rvq"], "falcon_h1": ["list", "list"],
              "deepseek_v3": ["rvq", "rvq"]}
    for arch, kinds in expect.items():
        model = models[arch]
        cache = rvqstore.make_prompt_cache(model, bits=(2, 2))
        prefill(model, prompt_tokens(40), cache)
        path = tmp_path / f"{arch}.rvq"
        rvqstore.save_prompt_cache(path, cache, tokens=prompt_tokens(40), model=model)
        with rvqstore.open(path) as f:
            assert [layer.kind for layer in f.layers] == kinds
            assert f.version == (1, 1) and "layer-kinds" in f.header.required_features or arch == "deepseek_v3"
            for layer in f.layers:
                if layer.kind == "rvq-rotating":
                    assert (layer.max_size, layer.keep, layer.offset, layer.n_tokens) == (WINDOW, 0, 40, WINDOW)
            if arch == "deepseek_v3":  # latent (32) and rope (16) parts: one quantizer per side
                assert (f.layers[0].head_dim, f.layers[0].value_head_dim) == (32, 16)
                assert "per-side-geometry" in f.header.required_features
        # another architecture's file is refused by layer kinds before anything is decoded
        with pytest.raises(rvqstore.ModelMismatchError, match="layer"):
            rvqstore.load_prompt_cache(path, model=models["llama"])


def test_cli_cache_prompt_and_generate_with_a_model_folder(tmp_path):
    folder = tmp_path / "gemma3-tiny"
    write_model_folder("gemma3_text", folder)
    out = tmp_path / "p.rvq"
    env = dict(os.environ, PYTHONPATH=python_path(ROOT))
    run = lambda *a: subprocess.run([sys.executable, "-m", "rvqstore", *a], capture_output=True, text=True,  # noqa: E731
                                    env=env, cwd=ROOT, timeout=300)
    r = run("cache-prompt", "--model", str(folder), "--prompt", "the quick brown fox jumps over the lazy dog",
            "-o", str(out), "--bits", "2+2")
    assert r.returncode == 0, r.stderr
    assert "cached 43 tokens" in r.stdout
    r = run("generate", "--model", str(folder), "--prompt-cache", str(out), "--prompt", " and", "--max-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert "reused 43 of 47 prompt tokens" in r.stderr
    # without --model the bundled model is loaded: refused, naming the folder and how to pass it
    r = run("generate", "--prompt-cache", str(out), "--max-tokens", "2")
    assert r.returncode != 0
    assert str(folder.resolve()) in r.stderr and "--model" in r.stderr


def test_lists_of_mlx_lm_caches_save_and_load(models, tmp_path):
    """mlx-lm's own RotatingKVCache / ArraysCache / CacheList lists: windows encoded, state kept bit for bit."""
    for arch in ("gemma3_text", "qwen3_next", "falcon_h1"):
        model = models[arch]
        cache = mlx_lm_prompt_cache(model)
        prefill(model, prompt_tokens(40), cache)
        path = tmp_path / f"{arch}.rvq"
        rvqstore.save_prompt_cache(path, cache, tokens=prompt_tokens(40), model=model, bits=(4, 4))
        loaded = rvqstore.load_prompt_cache(path, model=model)
        flat = lambda cs: [x for c in cs for x in getattr(c, "caches", [c])]  # noqa: E731
        for a, b in zip(flat(cache), flat(loaded)):
            if isinstance(a, ArraysCache):
                assert all(mx.array_equal(x, y).item() for x, y in zip(a.cache, b.cache))
            else:
                assert b.offset == a.offset == 40 and (not isinstance(b, RVQRotatingKVCache) or b.n_held == WINDOW)
        ref, got = step_logits(model, cache, MORE), step_logits(model, loaded, MORE)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.07


def test_resume_stops_where_a_moved_window_cannot_rewind(models, tmp_path):
    model = models["gemma3_text"]
    tokens = prompt_tokens(40)
    cache = rvqstore.make_prompt_cache(model, bits=(2, 2))
    prefill(model, tokens, cache)
    path = tmp_path / "g.rvq"
    rvqstore.save_prompt_cache(path, cache, tokens=tokens, model=model)
    prompt = tokens[:20] + [5, 6]  # shares 20 tokens, but the windows already dropped tokens 0..23
    r = rvqstore.resume(path, prompt, model)
    assert r.reused == 0 and r.remaining == prompt and r.stored == 40
    assert "layer 0 (RVQRotatingKVCache) holds a sliding window of 16 tokens" in r.reason
    fresh = rvqstore.make_prompt_cache(model, bits=(2, 2))
    np.testing.assert_array_equal(np.array(prefill(model, prompt, r.cache)), np.array(prefill(model, prompt, fresh)))
    r = rvqstore.resume(path, tokens + [5], model)
    assert r.reused == 40 and r.reason == "every stored token is reused"


def test_attention_on_codes_serves_only_calls_over_the_cache_own_arrays(models, monkeypatch):
    """Latent attention (deepseek_v3) attends over arrays derived from the cached latent: mlx-lm's path;
    a plain model's calls are served from the codes."""
    import rvqstore.attention as attention

    served = []
    real = attention.attend
    monkeypatch.setattr(attention, "attend", lambda *a, **k: served.append(1) or real(*a, **k))
    for arch, want in (("llama", True), ("deepseek_v3", False)):
        served.clear()
        cache = rvqstore.make_prompt_cache(models[arch], bits=(2, 2))
        step_logits(models[arch], cache, prompt_tokens(8))
        assert bool(served) == want, arch


def test_multimodal_wrapper_args_fingerprint_and_save(tmp_path):
    """qwen3_5 keeps its text model's args under text_config: fingerprint and snapshot work all the same."""
    sys.path.insert(0, str(ROOT / "tools"))
    from smoke_architectures import EXTRA, check

    r = check(EXTRA["qwen3_5"])
    assert r["kinds"] == ["arrays", "rvq", "arrays", "rvq"] and r["exact"] and r["rel"] < 0.07
