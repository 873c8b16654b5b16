"""Bound decode steps (rvqstore.decode_step) hand MLX what the regular paths hand it, on any machine.

The CUDA step path is entered on this machine with stand-ins for what needs a GPU (the backend's name, the
device, the kernel cache's binaries, MLX's precompiled launch, which records its arguments and hands back
zeros): two packed caches with the same codes take the same steps, one with steps bound and one without, and
every launch's kernel, grid, threadgroup, output shapes and inputs must match: the same arrays in the same
places (each input named by its first appearance or by the launch that made it), small constants by value.
That the kernels compute the same bits on a GPU is tests/test_decode_step_gpu.py's job.
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQKVCache, cache_append, cache_fetch, decode_step, fused, kernel_cache, kernel_ref
from rvqstore.attention import fold as attention_fold
from rvqstore.attention import kernel as attention_kernel
from rvqstore.attention import kernel_mma

B, HKV, HQ, D = 1, 2, 8, 64


class _Seen(list):
    """The launches recorded; ``base``: the current run's first launch (_run sets it)."""

    base = 0


@pytest.fixture
def stand_in(monkeypatch):
    """The CUDA path on this machine; returns the list the precompiled launch records into."""
    seen = _Seen()

    def precompiled(**kw):
        # every output filled with a value of its own (by launch in the run and output): what is written where shows
        i = len(seen) - seen.base
        out = [mx.full(s, 1 + i % 50 + 0.25 * j if d in (mx.float16, mx.bfloat16, mx.float32) else 1 + i % 50, d)
               for j, (s, d) in enumerate(zip(kw["output_shapes"], kw["output_dtypes"]))]
        seen.append((kw, out))
        return out

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    monkeypatch.setattr(fused, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fused, "_on_gpu", lambda: True)
    monkeypatch.setattr(kernel_cache, "cache_dir", lambda: Path("/nonexistent-rvqstore-test"))
    monkeypatch.setenv(kernel_ref.ENV, "0")
    monkeypatch.setattr(kernel_cache, "get_binary", lambda tu, func: (func, tu, "key-" + func))
    monkeypatch.setattr(kernel_cache, "verdict_key", lambda *a: "stand-in")
    monkeypatch.setattr(kernel_cache, "verdict", lambda key: True)  # first uses "checked on this machine"
    monkeypatch.setattr(kernel_cache, "record_verdict", lambda *a, **kw: None)
    # fresh kernels, plans and verdicts: nothing made with the stand-ins outlives the test
    for mod, name, fresh in ((cache_append, "_kernel_fns", dict), (cache_append, "_verified", set),
                             (cache_append, "_disabled", dict), (cache_fetch, "_kernel_fn", list),
                             (cache_fetch, "_verified", set), (cache_fetch, "_disabled", dict),
                             (attention_kernel, "_kernels", dict), (attention_kernel, "_verified", set),
                             (attention_kernel, "_disabled", dict), (kernel_mma, "_kernels", dict),
                             (attention_fold, "_verified", set), (attention_fold, "_disabled", dict)):
        monkeypatch.setattr(mod, name, fresh())
    for mod, name in ((attention_kernel, "_launches"), (attention_kernel, "_merges"),
                      (attention_kernel, "_decisions"), (kernel_mma, "_launches")):
        monkeypatch.setattr(mod, name, weakref.WeakKeyDictionary())
    monkeypatch.setattr(decode_step, "stats", {"bound": 0, "updates": 0, "attends": 0, "folds": 0})
    return seen


def _held(n: int):
    rng = np.random.default_rng(0)
    kv = [mx.array(rng.standard_normal((B, HKV, n, D)).astype(np.float32)).astype(mx.float16) for _ in range(2)]
    c = RVQKVCache((2, 2), use_kernels=False)  # coded on the CPU path
    c.update_and_fetch(*kv)
    mx.eval(c.state)
    return c.state[:6]


def _cache(held, mode: str = "packed") -> RVQKVCache:
    ks, k1, k2, vs, v1, v2 = [mx.array(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a))
                              for a in held]
    ks, vs = ks.view(mx.bfloat16), vs.view(mx.bfloat16)
    return RVQKVCache.from_packed(keys=(ks, k1, k2), values=(vs, v1, v2), dense_keys=None, dense_values=None,
                                  dtype=mx.float16, head_dims=(D, D), bits=(2, 2), mode=mode)


def _steps(n: int):
    rng = np.random.default_rng(1)
    return [tuple(mx.array(rng.standard_normal(s).astype(np.float16)) for s in
                  ((B, HQ, 1, D), (B, HKV, 1, D), (B, HKV, 1, D))) for _ in range(n)]


class Names:
    """Names arrays by role: made by the i-th launch (its j-th output), else by first appearance."""

    def __init__(self):
        self.made: dict = {}
        self.seen: dict = {}
        self.keep: list = []  # the arrays named (ids stay unique while they live)

    def made_by(self, i: int, outputs: list) -> None:
        for j, a in enumerate(outputs):
            self.made[id(a)] = ("launch", i, j)
            self.keep.append(a)

    def __call__(self, a):
        if a is None or not isinstance(a, mx.array):
            return a
        if id(a) in self.made:
            return self.made[id(a)]
        if id(a) not in self.seen:
            self.seen[id(a)] = len(self.seen)
            self.keep.append(a)
        small = tuple(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).ravel().tolist()) \
            if a.size <= 64 else None
        return ("array", self.seen[id(a)], tuple(a.shape), str(a.dtype), small)


def _run(seen: list, bound: bool, held, steps, mode: str = "packed") -> tuple[list, dict]:
    """A script of steps on a fresh cache: what it handed MLX and returned, every array named by role."""
    decode_step.ENABLED = bound
    first = len(seen)
    if isinstance(seen, _Seen):
        seen.base = first
    names = Names()
    log: list = []

    def record(what, arrays):
        for i in range(names_done[0], len(seen) - first):  # the launches since the last entry, in order
            kw, out = seen[first + i]
            log.append(("launch", kw["name"], kw["grid"], kw["threadgroup"], tuple(map(tuple, kw["output_shapes"])),
                        tuple(str(d) for d in kw["output_dtypes"]), tuple(names(a) for a in kw["inputs"])))
            names.made_by(i, out)
        names_done[0] = len(seen) - first
        log.append((what, tuple(names(a) for a in arrays)))

    names_done = [0]
    cache = _cache(held, mode)
    scale = D ** -0.5
    # steps, a trim back, growth past 256 tokens, and calls the bound step must refuse
    script = ["step"] * 8 + ["trim"] + ["step"] * 4 + ["mask"] + ["step"] * 2 + ["scale"] + ["step"] * 2 \
        + ["no-inplace"] + ["step"] * 3 + ["sinks"] + ["step"] * 2 + ["bf16-queries"] + ["step"] * 2
    for i, what in enumerate(script):
        q, k, v = steps[i]
        if what == "trim":
            cache.trim(3)
            record("trim", [])
            continue
        mask = sinks = None
        s = scale
        if what == "mask":
            mask = mx.ones((1, cache.offset + 1), dtype=mx.bool_)
        elif what == "scale":
            s = scale * 0.5
        elif what == "sinks":
            sinks = mx.zeros((HQ,), mx.float16)
        elif what == "bf16-queries":
            q = q.astype(mx.bfloat16)
        cache_append.INPLACE = what != "no-inplace"
        try:
            keys, values = cache.update_and_fetch(k, v)
            out = cache.attend_on_codes(q, scale=s, mask=mask, sinks=sinks)
        finally:
            cache_append.INPLACE = True
        ks, vs = cache._keys, cache._values
        copy = cache._mode if mode == "resident" else None
        record(what, [keys, values, out, ks._count, vs._count, ks._scales, ks._codes1, ks._codes2, vs._scales,
                      vs._codes1, vs._codes2] + ([copy.keys, copy.values] if copy else []))
        if copy is not None:  # what the copy holds, and what was handed out of it
            log.append(("copy", tuple(hashlib.sha256(np.array(a).tobytes()).hexdigest()[:16]
                                      for a in (copy.keys, copy.values, keys, values))))
        log.append(("state", cache.offset, ks._n, ks._hw, vs._n, vs._hw, len(ks._staged), len(vs._staged),
                    cache._fetched is None))
    return log, dict(decode_step.stats)


@pytest.mark.parametrize("kernel", ["mma", "mma-fused-merge", "simt"])
def test_bound_steps_hand_mlx_what_the_regular_paths_hand_it(stand_in, monkeypatch, kernel):
    monkeypatch.setattr(decode_step, "ENABLED", True)
    monkeypatch.setattr(attention_fold, "FOLD", False)  # the folded append: test_folded_steps_...
    monkeypatch.setattr(kernel_mma, "FUSED_MERGE", kernel == "mma-fused-merge")
    monkeypatch.setattr(kernel_mma, "TENSOR_CORES", kernel != "simt")
    held = _held(250)  # 250 tokens held: the first step grows the buffers to 256, a later one to 512
    steps = _steps(40)
    _run(stand_in, False, held, steps)  # first uses (their checks launch too): then both runs below launch alike
    regular, _ = _run(stand_in, False, held, steps)
    before = dict(decode_step.stats)
    bound, stats = _run(stand_in, True, held, steps)
    assert before == {"bound": 0, "updates": 0, "attends": 0, "folds": 0}  # the regular run bound nothing
    for i, (a, b) in enumerate(zip(bound, regular)):
        assert a == b, f"entry {i} differs:\n bound   {a}\n regular {b}"
    assert len(bound) == len(regular)
    # and the bound steps did serve: most single-token steps, on both sides
    assert stats["updates"] >= 12 and stats["attends"] >= 10 and stats["bound"] >= 3, stats
    names = {e[1] for e in bound if e[0] == "launch"}
    assert any(("mma" in n) == (kernel != "simt") and ("fused" in n) == (kernel == "mma-fused-merge")
               for n in names if "attend" in n), names  # the kernel asked for served


def test_bound_resident_steps_hand_mlx_what_the_regular_paths_hand_it(stand_in, monkeypatch):
    """Resident caches: the in-place append with the decoded token, written into the copy by slice updates,
    and the copy handed out; the same launches, updates and arrays as the regular path, across the copy's and
    the buffers' growth, a trim (then the codes are staged again until the buffers are renewed) and the steps
    the bound path refuses."""
    monkeypatch.setattr(decode_step, "ENABLED", True)
    held = _held(250)
    steps = _steps(40)
    _run(stand_in, False, held, steps, "resident")  # first uses
    regular, _ = _run(stand_in, False, held, steps, "resident")
    bound, stats = _run(stand_in, True, held, steps, "resident")
    for i, (a, b) in enumerate(zip(bound, regular)):
        assert a == b, f"entry {i} differs:\n bound   {a}\n regular {b}"
    assert len(bound) == len(regular)
    assert stats["updates"] >= 12 and stats["bound"] >= 1 and stats["attends"] == 0, stats
    # the steps wrote their codes in place (no staged codes) and handed out the copy, never a decode
    launches = [e[1] for e in bound if e[0] == "launch"]
    assert any("rvq_append_res_inplace" in n for n in launches), set(launches)
    assert not any("unpack" in n for n in launches), set(launches)


def test_full_resident_buffers_grow_and_write_in_place_at_once(stand_in, monkeypatch):
    """A resident cache whose code buffers are full (a loaded file; a prefill to a multiple of 256 tokens) grows
    them at its next step and writes in place from then on, binding the step after, as a packed cache does
    (it used to stage 16 steps' codes first: 16 unbound steps per 256 tokens)."""
    monkeypatch.setattr(decode_step, "ENABLED", True)
    cache = _cache(_held(256), "resident")
    assert cache._keys._scales.shape[-1] == 256  # full
    served = []
    for i, (_, k, v) in enumerate(_steps(6)):
        before = decode_step.stats["updates"]
        cache.update_and_fetch(k, v)
        served.append(decode_step.stats["updates"] > before)
        ks, vs = cache._keys, cache._values
        assert not ks._staged and not vs._staged, f"step {i} staged its codes"
        assert ks._count is not None and ks._n == vs._n == 257 + i  # written in place
    assert ks._scales.shape[-1] == 512
    assert served == [False] + [True] * 5, served


def test_changed_settings_unbind_attention(stand_in, monkeypatch):
    """A switch flipped between steps (here the tensor cores off) takes the regular path, which binds anew."""
    monkeypatch.setattr(decode_step, "ENABLED", True)
    cache = _cache(_held(100))
    steps = _steps(6)
    for i, (q, k, v) in enumerate(steps):
        if i == 3:
            monkeypatch.setattr(kernel_mma, "TENSOR_CORES", False)
        cache.update_and_fetch(k, v)
        cache.attend_on_codes(q, scale=0.125)
        kw = stand_in[-2][0] if i else None  # the split launch (the merge is the last)
        if i >= 3:
            assert "mma" not in kw["name"]
    assert decode_step.stats["attends"] >= 2


def _launch_of(seen, start: int, part: str):
    """The (kwargs, outputs) of the last launch since ``start`` whose kernel name holds ``part``."""
    hits = [e for e in seen[start:] if part in e[0]["name"]]
    assert hits, [e[0]["name"] for e in seen[start:]]
    return hits[-1]


def test_folded_steps_write_the_token_in_the_split_kernel(stand_in, monkeypatch):
    """The fold (rvqstore.attention.fold): once bound, a step's attention is the split kernel that takes the step's
    keys and values and the count from before the step, and the cache's count becomes that launch's ``done``, which
    the next step's append (for what update_and_fetch hands out) and attention take. The append's launch is still
    built for the unpack handed out, from the same count. A trim between update and attention leaves the token to the
    append (no fold); a step with no attention call leaves it to its append, and the next step folds only its own."""
    monkeypatch.setattr(decode_step, "ENABLED", True)
    monkeypatch.setattr(attention_fold, "FOLD", True)
    cache = _cache(_held(100))
    steps = _steps(12)
    scale = D ** -0.5
    folds = []
    for i, (q, k, v) in enumerate(steps[:6]):
        before = cache._keys._count
        start = len(stand_in)
        cache.update_and_fetch(k, v)
        n_before = decode_step.stats["folds"]
        cache.attend_on_codes(q, scale=scale)
        if decode_step.stats["folds"] == n_before:
            continue
        folds.append(i)
        append_kw, append_out = _launch_of(stand_in, start, "rvq_append")
        fold_kw, fold_out = _launch_of(stand_in, start, "mma_fold")
        assert append_kw["inputs"][7] is before  # the append (for the unpack) from the count before the step
        assert fold_kw["inputs"][10] is before  # and the fold from the same one
        assert fold_kw["inputs"][12] is k and fold_kw["inputs"][13] is v
        assert cache._keys._count is fold_out[2] and cache._values._count is fold_out[2]
        assert not any("unpack" in e[0]["name"] and e[0]["inputs"][8] is fold_out[2] for e in stand_in[start:])
        merge_kw, _ = stand_in[-1]
        assert merge_kw["inputs"][0] is fold_out[0] and merge_kw["inputs"][1] is fold_out[1]
    assert folds == [2, 3, 4, 5], folds  # step 0 binds the update, step 1 the attention (and the fold)
    # a step with no attention call: the next update's append takes this one's done, and only its token is folded
    q, k, v = steps[6]
    cache.update_and_fetch(k, v)
    first_done = cache._keys._count
    q, k, v = steps[7]
    start = len(stand_in)
    cache.update_and_fetch(k, v)
    assert _launch_of(stand_in, start, "rvq_append")[0]["inputs"][7] is first_done
    cache.attend_on_codes(q, scale=scale)
    fold_kw, _ = _launch_of(stand_in, start, "mma_fold")
    assert fold_kw["inputs"][10] is first_done and fold_kw["inputs"][12] is k
    # a trim between the update and the attention: the append's count stays, the plain split serves
    q, k, v = steps[8]
    cache.update_and_fetch(k, v)
    cache.trim(1)  # settles the pending write: the append's launch is evaluated, the token written
    folded = decode_step.stats["folds"]
    start = len(stand_in)
    cache.attend_on_codes(q, scale=scale)
    assert decode_step.stats["folds"] == folded
    assert not any("mma_fold" in e[0]["name"] for e in stand_in[start:])
    assert cache._keys._count is None


def test_a_fold_that_disagrees_at_first_use_stays_off(stand_in, monkeypatch, caplog):
    """First use compares the fold with the append and the split kernel on copies of the buffers (here the
    stand-in's launches fill their outputs with values of their own, so they disagree): the fold is latched off,
    said once, and bound steps take the append's launch and the plain split kernel."""
    monkeypatch.setattr(decode_step, "ENABLED", True)
    monkeypatch.setattr(attention_fold, "FOLD", True)
    # the fold not checked on this machine before (every other kernel was)
    monkeypatch.setattr(kernel_cache, "verdict_key", lambda what, *a: what)
    monkeypatch.setattr(kernel_cache, "verdict", lambda key: None if key.startswith("append folded") else True)
    cache = _cache(_held(100))
    for q, k, v in _steps(5):
        cache.update_and_fetch(k, v)
        cache.attend_on_codes(q, scale=D ** -0.5)
    assert attention_fold.disabled(), "the fold was not latched off"
    assert decode_step.stats["folds"] == 0 and decode_step.stats["attends"] >= 2
    assert "append folded into the split kernel" in caplog.text


def test_the_fold_is_off_unless_asked_for(stand_in, monkeypatch):
    """By default (``RVQSTORE_FOLD`` unset) bound steps launch the append on its own: nothing is folded."""
    monkeypatch.setattr(decode_step, "ENABLED", True)
    monkeypatch.setattr(attention_fold, "FOLD", attention_fold.os.environ.get("RVQSTORE_FOLD", "0").strip() == "1")
    cache = _cache(_held(100))
    for q, k, v in _steps(5):
        cache.update_and_fetch(k, v)
        cache.attend_on_codes(q, scale=D ** -0.5)
    assert decode_step.stats["attends"] >= 2
    assert (decode_step.stats["folds"] > 0) == attention_fold.FOLD
    assert any("mma_fold" in e[0]["name"] for e in stand_in) == attention_fold.FOLD
