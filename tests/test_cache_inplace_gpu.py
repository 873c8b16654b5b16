"""The in-place append on the GPU (kernels/rvq_append.inc with RVQ_APPEND_INPLACE, rvqstore.cache_append,
rvqstore.cache._Stream): a packed cache's decode steps write their codes straight into its buffers, and
what every reader sees is what the slice-update path would have written: attention on the codes, the
decode handed back, the state, whether or not each step was evaluated before the next one was built.
With RVQ_ATTN_PARITY_REPORT=path each comparison appends a line there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQKVCache, cache_append, fused
from rvqstore.attention import ops
from rvqstore.cache_modes import Packed
from gpu_report import record as _record  # noqa: E402


pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda_only():
    if fused.gpu_backend() != "cuda":
        pytest.skip("the in-place append is CUDA only")


def _tokens(n, h=4, d=128, seed=0, dtype=mx.float16):
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((1, h, n, d)).astype(np.float32)).astype(dtype) for _ in range(2))


def _no_inplace(monkeypatch):
    monkeypatch.setattr(Packed, "_inplace_append", staticmethod(lambda *a: False))
    monkeypatch.setattr(cache_append, "COPY_MAX_TOKENS", 0)  # the launch + slice updates


def _steps(k, v, q, *, prompt, end, evaluate=True, trim_at=None):
    """A packed cache fed ``prompt`` tokens, then one token per step up to ``end`` (a trim of 3 at
    ``trim_at``); per step the attention on its codes (evaluated per step, or only at the end)."""
    c = RVQKVCache((2, 2))
    c.update_and_fetch(k[:, :, :prompt], v[:, :, :prompt])
    outs, i = [], prompt
    while i < end:
        kk, vv = c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
        o = c.attend_on_codes(q, scale=0.088)
        if evaluate:
            mx.eval(o, kk, vv)
        outs.append(o)
        i += 1
        if i == trim_at:
            c.trim(3)
            i, trim_at = i - 3, None
    mx.eval(outs)
    return c, outs, (kk, vv)


def _same_state(a, b):
    return all((x is None and y is None) or bool(mx.array_equal(x, y, equal_nan=True).item())
               for x, y in zip(a.state, b.state))


@pytest.mark.parametrize("evaluate", [True, False], ids=["each-step", "built-ahead"])
def test_gpu_inplace_equals_slice_updates(monkeypatch, evaluate):
    # 200 prompt tokens, then single steps across the 256-token growth (a copy append) and a trim (after
    # which the buffers are copied once, then written in place again)
    k, v = _tokens(330)
    q = _tokens(1, h=16, seed=9)[0]
    fast, fo, fkv = _steps(k, v, q, prompt=200, end=320, evaluate=evaluate, trim_at=280)
    assert any("inplace" in cfg for cfg in cache_append._verified) and not cache_append.disabled()
    with monkeypatch.context() as m:
        _no_inplace(m)
        ref, ro, rkv = _steps(k, v, q, prompt=200, end=320, evaluate=True, trim_at=280)
    same_attn = all(bool(mx.array_equal(a, b).item()) for a, b in zip(fo, ro))
    same_fetch = all(bool(mx.array_equal(a, b).item()) for a, b in zip(fkv, rkv))
    ok = same_attn and same_fetch and _same_state(fast, ref) and fast.offset == ref.offset
    _record("inplace-vs-slice-updates", ok, f"{'evaluated per step' if evaluate else 'steps built ahead'}: "
            f"{len(fo)} steps, attention bit-identical={same_attn}, fetch={same_fetch}")
    assert ok


def test_gpu_mlx_ops_readers_see_pending_writes():
    # steps built and never evaluated: every other reader (the state, the MLX-ops attention, the
    # used codes) finishes the pending write first and reads what the kernel path reads
    k, v = _tokens(80, seed=3)
    q = _tokens(1, h=16, seed=4)[0]
    c = RVQKVCache((2, 2))
    c.update_and_fetch(k[:, :, :60], v[:, :, :60])
    for i in range(60, 80):
        c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
    assert c._keys._count is not None  # written in place, pending
    fast = c.attend_on_codes(q, scale=0.088)
    slow = ops.attend(c.codes_view(), q, 0.088)
    ref = RVQKVCache((2, 2))
    ref.update_and_fetch(k, v)  # all 80 at once: no in-place write
    err = float(mx.abs(fast.astype(mx.float32) - slow.astype(mx.float32)).max())
    ok = _same_state(c, ref) and err < 4 * 2 ** -11 * float(mx.abs(v).max())
    _record("inplace-mlx-ops-readers", ok, f"state equal to one update of 80 tokens; |kernel - MLX ops| {err:.2e}")
    assert ok


def test_gpu_greedy_random_model_inplace_matches_slice_updates(monkeypatch):
    """40 greedy tokens of a random-weight llama (fp16, GQA 4, head dim 128) through mlx-lm's own loop
    (``generate_step``: each step built while the last one runs): token-identical either way."""
    from mlx_lm.generate import generate_step
    from tiny_models import gpu_llama

    from rvqstore import make_prompt_cache

    model = gpu_llama()
    prompt = mx.array(np.random.default_rng(1).integers(0, 512, 250))

    def run():
        cache = make_prompt_cache(model, (2, 2))
        return [int(t) for t, _ in zip((tok for tok, _ in generate_step(prompt, model, prompt_cache=cache)),
                                       range(40))]

    fast = run()
    assert any("inplace" in cfg for cfg in cache_append._verified)
    with monkeypatch.context() as m:
        _no_inplace(m)
        ref = run()
    first = next((i for i, (a, b) in enumerate(zip(fast, ref)) if a != b), None)
    _record("inplace-greedy-random-llama-40", fast == ref, f"first difference at {first}")
    assert fast == ref
