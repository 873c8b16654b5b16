"""The model check fails closed (issue 12, item 4): fingerprint identity keys are required, attention
geometry is checked from the layer maps with or without a fingerprint, the fingerprint memo sees
in-place weight edits. Tiny random-weight mlx-lm models, real files."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rvqstore.prompt_cache as pc
from rvqstore import RVQKVCache, load_prompt_cache, make_prompt_cache, resume, save_prompt_cache
from rvqstore.errors import ModelMismatchError
from rvqstore.generation import prefill
from rvqstore.model_check import IDENTITY_KEYS, fingerprint, model_geometry

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build  # noqa: E402

TOKENS = list(range(3, 15))


@pytest.fixture(scope="module")
def llama():
    return build("llama")[0]  # 2 layers, 2 kv heads, head dim 16


@pytest.fixture()
def snapshot(llama, tmp_path):
    cache = make_prompt_cache(llama, bits=(2, 2))
    prefill(llama, TOKENS, cache)
    path = tmp_path / "s.rvq"
    return path, cache


def _random_caches(n_layers, heads, dim, t=len(TOKENS)):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n_layers):
        c = RVQKVCache((2, 2))
        k = mx.array(rng.standard_normal((1, heads, t, dim)).astype(np.float32))
        c.update_and_fetch(k, k)
        out.append(c)
    return out


@pytest.mark.parametrize("heads,dim,what", [(3, 16, "n_kv_heads"), (2, 32, "head_dim"), (1, 64, "n_kv_heads")])
def test_geometry_is_checked_without_a_fingerprint(llama, tmp_path, heads, dim, what):
    path = tmp_path / "nofp.rvq"
    save_prompt_cache(path, _random_caches(2, heads, dim), tokens=TOKENS)  # no model: no fingerprint
    with pytest.raises(ModelMismatchError, match=r"layer 0: \(n_kv_heads, head_dim, value_head_dim\)"):
        load_prompt_cache(path, model=llama)
    with pytest.raises(ModelMismatchError):
        resume(path, TOKENS + [5], llama)
    assert len(load_prompt_cache(path)) == 2  # without a model nothing is compared


def test_matching_geometry_without_a_fingerprint_loads(llama, tmp_path):
    path = tmp_path / "ok.rvq"
    save_prompt_cache(path, _random_caches(2, 2, 16), tokens=TOKENS)
    assert [c.offset for c in load_prompt_cache(path, model=llama)] == [len(TOKENS)] * 2


def test_save_refuses_caches_that_do_not_fit_the_model(llama, tmp_path):
    path = tmp_path / "never.rvq"
    with pytest.raises(ModelMismatchError, match="the cache"):
        save_prompt_cache(path, _random_caches(2, 4, 16), tokens=TOKENS, model=llama)
    assert not path.exists()


CRAFTED = {
    "empty map": lambda fp: {},
    "only unknown keys": lambda fp: {"weights_blake3": "00", "arch": "llama"},
    "renamed weights_sha256": lambda fp: {("weights_sha256_v3" if k == "weights_sha256" else k): v for k, v in fp.items()},
    "no model_type": lambda fp: {k: v for k, v in fp.items() if k != "model_type"},
}


@pytest.mark.parametrize("name", CRAFTED)
def test_fingerprint_without_its_identity_keys_is_refused(llama, snapshot, monkeypatch, name):
    path, cache = snapshot
    real = fingerprint(llama, None)
    monkeypatch.setattr(pc, "_fingerprint", lambda model, tok: CRAFTED[name](real))
    save_prompt_cache(path, cache, tokens=TOKENS, model=llama)  # a real file whose checksums are all right
    monkeypatch.undo()
    with pytest.raises(ModelMismatchError, match="fingerprint"):
        load_prompt_cache(path, model=llama)
    with pytest.raises(ModelMismatchError):
        resume(path, TOKENS, llama)


def test_extra_keys_beside_the_identity_keys_are_accepted(llama, snapshot, monkeypatch):
    path, cache = snapshot
    real = fingerprint(llama, None)
    monkeypatch.setattr(pc, "_fingerprint", lambda model, tok: {**real, "weights_blake3": "ab", "source": "x"})
    save_prompt_cache(path, cache, tokens=TOKENS, model=llama)
    monkeypatch.undo()
    assert len(load_prompt_cache(path, model=llama)) == 2
    assert set(IDENTITY_KEYS) <= set(real)


def test_in_place_weight_edit_is_noticed(llama, snapshot):
    path, cache = snapshot
    save_prompt_cache(path, cache, tokens=TOKENS, model=llama)
    assert len(load_prompt_cache(path, model=llama)) == 2  # memo filled
    w = llama.model.norm.weight
    before = w[0].item()
    w[0] += 1.0  # in place: the same array object, new values
    mx.eval(w)
    assert llama.model.norm.weight is w
    try:
        with pytest.raises(ModelMismatchError, match="weights_sha256"):
            load_prompt_cache(path, model=llama)
    finally:
        w[0] = before
        mx.eval(w)
    assert len(load_prompt_cache(path, model=llama)) == 2


@pytest.mark.parametrize("arch,want", [
    ("llama", [("kv", 2, 16, 16)] * 2),
    # MLA caches one shared latent "head" (kv_lora_rank 32 | rope dim 16), not num_key_value_heads=4:
    # only the model's own caches tell
    ("deepseek_v3", [("kv", 1, 32, 16)] * 2),
    ("gemma3_text", [("kv", 1, 32, 32)] * 3),  # sliding and global layers
    ("qwen3_next", [None, ("kv", 2, 16, 16)] * 2),  # recurrent layers have no head geometry
])
def test_geometry_is_read_from_the_model_itself(arch, want):
    model = build(arch)[0]
    assert model_geometry(model) == want


class _Opaque:
    """A model that cannot take a bare one-token call (and optionally hides its args)."""

    def __init__(self, model, with_args: bool):
        self.layers = model.layers
        self._model = model
        if with_args:
            self.args = model.args

    def parameters(self):
        return self._model.parameters()

    def __call__(self, *args, **kwargs):
        raise RuntimeError("this model needs more than token ids")


def test_geometry_falls_back_to_args_then_fails_closed(llama, tmp_path):
    path = tmp_path / "nofp.rvq"
    save_prompt_cache(path, _random_caches(2, 3, 16), tokens=TOKENS)  # 3 heads: wrong for llama
    with pytest.raises(ModelMismatchError, match="n_kv_heads"):
        load_prompt_cache(path, model=_Opaque(llama, with_args=True))  # read from the args instead
    assert model_geometry(_Opaque(llama, with_args=True)) == [("kv", 2, 16, 16)] * 2
    good = tmp_path / "good.rvq"
    save_prompt_cache(good, _random_caches(2, 2, 16), tokens=TOKENS)
    with pytest.raises(ModelMismatchError, match="cannot be read"):  # nothing vouches for the file
        load_prompt_cache(good, model=_Opaque(llama, with_args=False))
