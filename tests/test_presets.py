"""rvqstore.presets and per-side bits in RVQKVCache: budgets kept, caches built, and a snapshot
of a per-side cache saved, reloaded bit for bit and resumed with its settings."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "tools" / "results" / "quality-sensitivity-smollm2.json"  # the Lloyd–Max forms' allocation
STATE_PROFILE = ROOT / "tools" / "results" / "quality-sensitivity-smollm2-state.json"  # the grid forms' (codec state)

import rvqstore  # noqa: E402
from rvqstore import CodecConfigError, RVQCodec, RVQKVCache, presets  # noqa: E402
from rvqstore.generation import prefill  # noqa: E402


@pytest.mark.parametrize("name,budget", [("near-lossless", 6.0), ("balanced", 4.5), ("small", 3.0)])
def test_presets_name_their_on_disk_budget_and_favour_keys(name, budget):
    p = presets.get(name)
    assert p.budget == budget
    # files are smaller than the in-memory width, so the settings spend more than the budget in memory:
    # Lloyd–Max codes at most what zstd can take back, uniform grids (rANS in "best" files) more
    # (the on-disk promise itself: test_preset_files_keep_their_budget)
    assert budget <= p.alloc_target <= budget + 0.6
    assert p.memory_bits(64) <= budget + (2.5 if p.key_step is not None else 0.5)
    assert p.key_step is None or p.memory_bits(64) > budget
    (kb, ks), (vb, vs) = p.sides()
    if ks is None:
        assert RVQCodec(64, kb).predicted_relative_error() <= RVQCodec(64, vb).predicted_relative_error()
    else:  # a grid's error is step^2/12: finer keys
        assert ks < vs and kb >= vb and p.compress() == "best"
    assert p.compress(profile="p") == ("best" if p.step_scale is not None else "auto")


@pytest.mark.model
def test_preset_files_keep_their_on_disk_budget(smollm2, sample_tokens, tmp_path):
    """The promise itself: the keys and values of 512 tokens of real text (the bundled model, one
    float32 prefill) coded by each preset, per side and per layer with the SmolLM2 profile (for the grid
    forms, which hold the codec state, the profile measured with it), in both forms (uniform grids with
    the sink token and key mean; Lloyd–Max with grid=False), saved with the preset's compress mode, everything
    counted: within each preset's budget, and not far below it. One grid file is written with "best"
    for real; the others' "best" size is the estimate from their "auto" file that the evaluation fits
    with (tools/quality/disk_bits.best_from_auto, within 0.3% of the real file:
    tests/test_eval_quality.py), since numpy rANS encoding takes tens of seconds per file."""
    from mlx_lm.models.cache import KVCache

    sys.path.insert(0, str(ROOT / "tools"))
    from quality.disk_bits import best_from_auto

    model, tok = smollm2
    ids = sample_tokens[:512]
    exact = [KVCache() for _ in model.layers]
    prefill(model, ids, exact)
    n_coords = len(ids) * len(model.layers) * model.args.num_key_value_heads * 64 * 2
    for name, p in presets.PRESETS.items():
        for with_profile in (False, True):
            for grid in (True, False):
                profile = (STATE_PROFILE if grid else PROFILE) if with_profile else None
                caches = presets.make_cache(model, name, profile=profile, grid=grid)
                for c, e in zip(caches, exact):
                    c.update_and_fetch(e.keys[..., :e.offset, :], e.values[..., :e.offset, :])
                mode = p.compress(profile, grid)
                real = mode == "auto" or (name, profile) == ("balanced", None)
                path = tmp_path / f"{name}-{profile is None}-{grid}.rvq"
                size = rvqstore.save_prompt_cache(path, caches, tokens=ids, model=model, tokenizer=tok,
                                                  compress=mode if real else "auto")
                bits = (size if real else best_from_auto(str(path))) * 8 / n_coords
                assert p.budget - 0.6 < bits <= p.budget, (name, profile, grid, bits)


def test_unknown_preset_is_a_typed_error():
    with pytest.raises(CodecConfigError, match="unknown preset 'tiny'.*balanced"):
        presets.get("tiny")
    with pytest.raises(CodecConfigError):
        presets.get(None)


def test_bad_value_bits_refused_before_any_state():
    with pytest.raises(CodecConfigError):
        RVQKVCache((4, 1), value_bits=(5, 0))


def test_per_side_cache_codes_each_side_with_its_codec():
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal((1, 2, 20, 64)).astype(np.float32)) for _ in range(2))
    c = RVQKVCache((4, 1), value_bits=(2, 1))
    kk, vv = c.update_and_fetch(k, v)
    ck, cv = RVQCodec(64, (4, 1)), RVQCodec(64, (2, 1))
    assert np.array_equal(np.array(kk), np.array(ck.decode(ck.encode(k))))
    assert np.array_equal(np.array(vv), np.array(cv.decode(cv.encode(v))))
    same = RVQKVCache((4, 1))
    assert same.value_bits == (4, 1)


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import build

    return build("llama")[0]


@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_preset_snapshot_roundtrip_and_resume(tiny, tmp_path, name):
    """Each preset's two sides (bits, and grid steps where it has them) survive a file saved with the
    preset's compress mode, a load (bit for bit) and a resume."""
    p = presets.get(name)
    (kb, ks), (vb, vs) = p.sides()
    st = p.state()
    state = (st.get("sink_tokens", 0), st.get("center_keys", False))
    caches = presets.make_cache(tiny, name)
    assert all(type(c) is RVQKVCache and (c.codec_bits, c.value_bits, c.step, c.value_step) == (kb, vb, ks, vs)
               and (c.sink_tokens, c.center_keys) == state for c in caches)
    toks = [int(i) for i in np.random.default_rng(1).integers(3, 128, 30)]
    prefill(tiny, toks, caches)
    # the codec state is held: the first positions exact (16-bit), a key mean when centering
    assert all(c.n_sink == state[0] and (c.key_mean is not None) == state[1] for c in caches)
    path = tmp_path / "p.rvq"
    rvqstore.save_prompt_cache(path, caches, tokens=toks, model=tiny, compress=p.compress())
    back = rvqstore.load_prompt_cache(path, model=tiny)
    for a, b in zip(caches, back):
        assert (b.codec_bits, b.value_bits, b.step, b.value_step) == (kb, vb, ks, vs)
        assert (b.sink_tokens, b.center_keys, b.n_sink) == (*state, state[0])
        for x, y in zip(a.keys_and_values(), b.keys_and_values()):
            assert np.array_equal(np.array(x), np.array(y))
    r = rvqstore.resume(path, toks + [5, 6], tiny)
    assert r.reused == 30 and all((c.value_bits, c.value_step, c.sink_tokens, c.center_keys) == (vb, vs, *state)
                                  for c in r.cache)


def test_only_the_grid_forms_carry_codec_state(tiny):
    """Presets with state give it to their grid caches (with a profile too); their Lloyd–Max forms
    (grid=False), fitted without it, stay as they were. At least one preset carries state."""
    with_state = [n for n, p in presets.PRESETS.items() if p.state()]
    assert with_state
    sens = {(l, s): 1.0 + l for l in range(len(tiny.layers)) for s in "kv"}
    for name in with_state:
        p = presets.get(name)
        assert p.state() == p.state(sens) == {"sink_tokens": p.sink_tokens, "center_keys": p.center_keys}
        assert p.state(grid=False) == {}
        for c in presets.make_cache(tiny, name, profile=sens):
            assert (c.sink_tokens, c.center_keys) == (p.sink_tokens, p.center_keys)
        for c in presets.make_cache(tiny, name, grid=False):
            assert (c.sink_tokens, c.center_keys, c.step) == (0, False, None)


@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_profile_allocates_per_layer_within_the_budget(tiny, tmp_path, name):
    n = len(tiny.layers)
    sens = {(l, s): (5.0 if l == 0 else 1.0) * (3.0 if s == "k" else 1.0) for l in range(n) for s in "kv"}
    p = presets.get(name)
    settings = p.layer_settings(n, sens)
    caches = presets.make_cache(tiny, name, profile=sens)
    assert [((c.codec_bits, c.step), (c.value_bits, c.value_step)) for c in caches] == settings
    assert [(k[0], v[0]) for k, v in settings] == p.layer_bits(n, sens)
    if p.step_scale is None:  # Lloyd–Max bits at the fixed-width target
        avg = sum(RVQCodec(64, k[0]).bits_per_coordinate + RVQCodec(64, v[0]).bits_per_coordinate
                  for k, v in settings) / (2 * n)
        assert avg <= p.alloc_target
    else:  # grid steps ~ 1/sqrt(sensitivity): 15x the sensitivity of the layer-1 values -> ~1/3.9 of the step
        steps = {(l, s): (settings[l][0] if s == "k" else settings[l][1])[1] for l in range(n) for s in "kv"}
        assert steps[(0, "k")] < steps[(0, "v")] < steps[(1, "v")]
        assert steps[(1, "v")] / steps[(0, "k")] == pytest.approx(15 ** 0.5, rel=0.2)
    f = tmp_path / "prof.json"
    f.write_text('{"slots": {"0:k": 1.0, "0:v": 0.5}}')
    with pytest.raises(CodecConfigError, match="another model"):
        presets.make_cache(tiny, "balanced", profile=f)
    f.write_text("not json")
    with pytest.raises(CodecConfigError, match="not a sensitivity profile"):
        presets.make_cache(tiny, "balanced", profile=f)


def test_cli_cache_prompt_with_a_preset_and_a_profile(tmp_path, capsys):
    """``cache-prompt --preset balanced --profile P``: the file holds the preset's per-layer, per-side bits."""
    import json
    import os
    import subprocess

    from subprocess_env import python_path
    from tiny_models import write_model_folder

    folder = tmp_path / "llama-tiny"
    model = write_model_folder("llama", folder)
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"slots": {"0:k": 9.0, "0:v": 1.0, "1:k": 0.5, "1:v": 0.1}}))
    env = dict(os.environ, PYTHONPATH=python_path(ROOT))

    def run(*a):
        return subprocess.run([sys.executable, "-m", "rvqstore", "cache-prompt", "--model", str(folder),
                               "--prompt", "the quick brown fox jumps over the lazy dog", *map(str, a)],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)

    out = tmp_path / "p.rvq"
    r = run("-o", out, "--preset", "balanced", "--profile", prof)
    assert r.returncode == 0, r.stderr
    want = presets.get("balanced").layer_settings(2, {(0, "k"): 9.0, (0, "v"): 1.0, (1, "k"): 0.5, (1, "v"): 0.1})
    back = rvqstore.load_prompt_cache(out, model=model)
    assert [((c.codec_bits, c.step), (c.value_bits, c.value_step)) for c in back] == want and want[0] != want[1]
    with rvqstore.open(out) as f:
        assert f.metadata.get("preset") == "balanced"
    # unknown names, --bits with --preset, --profile alone: one line, status 2, before the model loads
    from rvqstore.cli import main

    for args, needle in ((("--preset", "tiny"), "unknown preset 'tiny'"), (("--preset", "small", "--bits", "2+2"),
                         "not both"), (("--profile", prof), "--preset")):
        capsys.readouterr()
        try:
            code = main(["cache-prompt", "--model", str(folder), "--prompt", "x", "-o", str(tmp_path / "x.rvq"),
                         *map(str, args)])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "x.rvq").exists()
