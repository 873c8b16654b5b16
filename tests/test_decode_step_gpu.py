"""Bound decode steps on the GPU (rvqstore.decode_step): the same bits as the regular paths.

Two packed caches take the same prompt and the same single-token steps, one with its steady steps bound
and one without; attention on the codes, the decode handed back, the count of tokens and the saved state
must be bit-identical after every step (evaluated per step, or only at the end), through a trim and
through the buffers' growth, over head dims, GQA ratios and bit widths; and greedy generation of an
mlx-lm model is token-identical. With RVQ_ATTN_PARITY_REPORT=path each comparison appends a line there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQKVCache, cache_append, decode_step, fused
from rvqstore.attention import fold
from gpu_report import record as _record  # noqa: E402


pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda_only():
    if fused.gpu_backend() != "cuda":
        pytest.skip("bound decode steps are CUDA only")


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b, equal_nan=True).item())


def _run(bound: bool, monkeypatch, *, bits, d, hkv, group, prompt, steps, evaluate, trim_at, mode="packed", batch=1):
    monkeypatch.setattr(decode_step, "ENABLED", bound)
    rng = np.random.default_rng(d + hkv + group)
    total = prompt + steps
    k, v = (mx.array(rng.standard_normal((batch, hkv, total, d)).astype(np.float32)).astype(mx.float16)
            for _ in range(2))
    qs = mx.array(rng.standard_normal((steps, batch, hkv * group, 1, d)).astype(np.float32)).astype(mx.float16)
    c = RVQKVCache(bits, mode=mode)
    c.update_and_fetch(k[:, :, :prompt], v[:, :, :prompt])
    outs, fetched = [], []
    for i in range(steps):
        t = prompt + i
        kk, vv = c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        # resident: attention runs on the copy handed out (decode-then-SDPA), so the copy is what is compared
        # (MLX's SDPA on CUDA is not bit-reproducible from run to run on the same inputs: 2026-12-02 on the H200,
        # one in 20-40 calls of the same code differed)
        o = c.attend_on_codes(qs[i], scale=d ** -0.5) if mode == "packed" else kk
        if evaluate:
            mx.eval(o)
        outs.append(o)
        if i % 7 == 3 or mode == "resident":  # now and then the decode handed back is read too (resident: always)
            fetched.append((kk, vv))
        if i == trim_at:
            c.trim(3)
    mx.eval(outs, fetched, c.state)
    return outs, fetched, [mx.array(a) for a in c.state[:6]], c.offset


@pytest.mark.parametrize("bits,d,hkv,group,batch", [((2, 2), 128, 8, 4, 1), ((4, 2), 128, 8, 4, 1),
                                                    ((2, 2), 128, 2, 8, 1), ((2, 2), 64, 4, 1, 1),
                                                    ((4, 2), 64, 8, 4, 1), ((4, 4), 128, 8, 4, 1),
                                                    ((1, 1), 128, 4, 4, 1), ((2, 2), 128, 4, 4, 2)])
@pytest.mark.parametrize("evaluate", [True, False])
@pytest.mark.parametrize("folded", [False, True])
def test_bound_steps_compute_what_the_regular_paths_compute(monkeypatch, bits, d, hkv, group, batch, evaluate, folded):
    """Bound steps (``folded``: their appends folded into the split kernel, rvqstore.attention.fold) against the
    regular paths (the append's own launch, then the split kernel)."""
    monkeypatch.setattr(fold, "FOLD", folded)
    before = dict(decode_step.stats)
    # 250 prompt tokens: the steps cross 256 (the buffers grow) and a trim back at step 20
    kw = dict(bits=bits, d=d, hkv=hkv, group=group, prompt=250, steps=40, evaluate=evaluate, trim_at=20, batch=batch)
    got = _run(True, monkeypatch, **kw)
    served = {k: decode_step.stats[k] - before[k] for k in before}
    want = _run(False, monkeypatch, **kw)
    ok_out = all(_same(a, b) for a, b in zip(got[0], want[0]))
    ok_fetch = all(_same(a, b) for pa, pb in zip(got[1], want[1]) for a, b in zip(pa, pb))
    ok_state = all(_same(a, b) for a, b in zip(got[2], want[2])) and got[3] == want[3]
    ok = ok_out and ok_fetch and ok_state
    _record("decode-step", ok, f"bits={bits} d={d} hkv={hkv} group={group} batch={batch} evaluate={evaluate} "
            f"folded={folded} served={served} fold off={fold.disabled()}")
    assert ok_out and ok_fetch and ok_state
    assert served["updates"] >= 25 and served["attends"] >= 25, served  # and most steps were bound ones
    if folded:
        assert not fold.disabled() and served["folds"] >= 25, (served, fold.disabled())
    else:
        assert served["folds"] == 0, served


@pytest.mark.parametrize("bits,d,hkv,group", [((2, 2), 128, 8, 4), ((4, 2), 128, 8, 4), ((2, 2), 64, 4, 1)])
@pytest.mark.parametrize("evaluate", [True, False])
def test_bound_resident_steps_compute_what_the_regular_paths_compute(monkeypatch, bits, d, hkv, group, evaluate):
    """Resident caches: the codes written in place with the decoded token from the same launch; the copy handed
    out, attention over it and the saved codes bit-identical to the regular paths (which stage the codes)."""
    before = dict(decode_step.stats)
    kw = dict(bits=bits, d=d, hkv=hkv, group=group, prompt=250, steps=40, evaluate=evaluate, trim_at=20,
              mode="resident")
    got = _run(True, monkeypatch, **kw)
    served = {k: decode_step.stats[k] - before[k] for k in before}
    monkeypatch.setattr(cache_append, "INPLACE", False)  # the reference: codes staged, written by slice updates
    want = _run(False, monkeypatch, **kw)
    ok_out = all(_same(a, b) for a, b in zip(got[0], want[0]))
    ok_fetch = all(_same(a, b) for pa, pb in zip(got[1], want[1]) for a, b in zip(pa, pb))
    ok_state = all(_same(a, b) for a, b in zip(got[2], want[2])) and got[3] == want[3]
    ok = ok_out and ok_fetch and ok_state
    _record("decode-step-resident", ok, f"bits={bits} d={d} hkv={hkv} group={group} evaluate={evaluate} "
            f"served={served}")
    assert ok_out and ok_fetch and ok_state
    assert served["updates"] >= 20, served


@pytest.mark.parametrize("mode", ["packed", "resident", "packed-folded"])
def test_greedy_generation_is_token_identical_with_bound_steps(monkeypatch, mode):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=512, num_hidden_layers=4, intermediate_size=1024,
                           num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                           head_dim=128, rope_theta=10000.0, tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, (1, 300)), dtype=mx.int32)

    monkeypatch.setattr(fold, "FOLD", mode == "packed-folded")
    arm, mode = mode, mode.partition("-")[0]

    def generate(bound):
        monkeypatch.setattr(decode_step, "ENABLED", bound)
        caches = [RVQKVCache((2, 2), mode=mode) for _ in range(args.num_hidden_layers)]
        y = mx.argmax(model(prompt, cache=caches)[:, -1], axis=-1)
        toks = []
        for _ in range(64):
            toks.append(int(y.item()))
            y = mx.argmax(model(y[:, None], cache=caches)[:, -1], axis=-1)
        return toks

    before, folds = decode_step.stats["updates"], decode_step.stats["folds"]
    got = generate(True)
    served, folded = decode_step.stats["updates"] - before, decode_step.stats["folds"] - folds
    want = generate(False)
    _record("decode-step-generation", got == want, f"{arm}: 64 tokens, 4 layers, served={served}, "
            f"folded={folded}")
    assert got == want
    assert served >= 4 * 50
    assert (folded >= 4 * 50) if fold.FOLD else folded == 0
