"""Scratch: where bound resident steps part from the staged reference (GPU)."""
import sys
sys.path.insert(0, "tests")
import mlx.core as mx
import numpy as np
from rvqstore import RVQKVCache, cache_append, decode_step


def run(bound, inplace, bits, d, hkv, group, evaluate, prompt=250, steps=40, trim_at=20):
    decode_step.ENABLED = bound
    cache_append.INPLACE = inplace
    rng = np.random.default_rng(d + hkv + group)
    total = prompt + steps
    k, v = (mx.array(rng.standard_normal((1, hkv, total, d)).astype(np.float32)).astype(mx.float16) for _ in range(2))
    qs = mx.array(rng.standard_normal((steps, 1, hkv * group, 1, d)).astype(np.float32)).astype(mx.float16)
    c = RVQKVCache(bits, mode="resident")
    c.update_and_fetch(k[:, :, :prompt], v[:, :, :prompt])
    outs, fetched = [], []
    for i in range(steps):
        t = prompt + i
        kk, vv = c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        o = mx.fast.scaled_dot_product_attention(qs[i], kk, vv, scale=d ** -0.5)
        if evaluate:
            mx.eval(o)
        outs.append(o)
        fetched.append((kk, vv))
        if i == trim_at:
            c.trim(3)
    mx.eval(outs, fetched, c.state)
    return outs, fetched, [mx.array(a) for a in c.state[:6]]


def same(a, b):
    return a.shape == b.shape and bool(mx.array_equal(a, b, equal_nan=True).item())


for bits, d, hkv, group in [((2, 2), 128, 8, 4), ((4, 2), 128, 8, 4), ((2, 2), 64, 4, 1)]:
    for evaluate in (True, False):
        ref = run(False, False, bits, d, hkv, group, evaluate)
        ref2 = run(False, False, bits, d, hkv, group, evaluate)
        for name, (b, ip) in {"ref-again": (None, None), "inplace-unbound": (False, True), "inplace-bound": (True, True)}.items():
            got = ref2 if name == "ref-again" else run(b, ip, bits, d, hkv, group, evaluate)
            o = [i for i, (x, y) in enumerate(zip(got[0], ref[0])) if not same(x, y)]
            fk = [i for i, (x, y) in enumerate(zip(got[1], ref[1])) if not same(x[0], y[0])]
            fv = [i for i, (x, y) in enumerate(zip(got[1], ref[1])) if not same(x[1], y[1])]
            st = [i for i, (x, y) in enumerate(zip(got[2], ref[2])) if not same(x, y)]
            extra = ""
            if fk:
                i = fk[0]
                x, y = np.array(got[1][i][0]), np.array(ref[1][i][0])
                bad = np.argwhere(x != y)
                extra = f" first bad key step {i}: {len(bad)} elems, tokens {sorted(set(bad[:, 2].tolist()))[:8]}"
            print(bits, d, hkv, group, evaluate, name, "outs", o[:5], "keys", fk[:5], "vals", fv[:5], "state", st, extra,
                  flush=True)
