"""The fused append's outputs for fixed inputs, written to an .npz: run from two checkouts, compare bit for bit.

For kernel changes meant to keep every bit (kernels/rvq_append.inc): each head dim the kernel takes, 1+1, 2+2, 4+2
and 4+4, plain / resident / copy / in place (plain and resident), float16 and bfloat16 vectors with ordinary rows, rows of zeros,
huge rows (past the norm's limit) and a NaN.

    python tools/dump_append.py OUT.npz            # on a CUDA machine, from each checkout
    python tools/dump_append.py --compare A.npz B.npz

(``tools/gpu_steps.sh append-bits`` runs both against a reference checkout in ``.gpu/oldtree``; the copy role's new
buffers are compared on the positions it writes, the rest of them is never written.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def _buffers(codec, cap: int) -> tuple:
    """Zeroed (norms, codes1, codes2) buffers of ``cap`` tokens for 8 heads, each with memory of its own (made from
    numpy: an ``mx.zeros`` may be a broadcast of one element, which an in-place write must not reach)."""
    import mlx.core as mx

    norms = mx.array(np.zeros((1, 8, cap), np.uint16)).view(mx.bfloat16)
    out = (norms, mx.array(np.zeros((1, 8, cap, codec.words1), np.uint32)),
           mx.array(np.zeros((1, 8, cap, codec.words2), np.uint32)))
    mx.eval(out)
    return out


def dump(path: str) -> None:
    import mlx.core as mx

    from rvqstore import RVQCodec, cache_append

    out = {}
    rng = np.random.default_rng(7)
    for d in (32, 64, 128, 256):
        for bits in ((2, 2), (4, 2), (1, 1), (4, 4)):
            codec = RVQCodec(d, bits, seed=3)
            for dtype in (mx.float16, mx.bfloat16):
                x = rng.standard_normal((2, 8, 3, d)).astype(np.float32) * rng.uniform(0.01, 30, (2, 8, 3, 1))
                x[0, 1, 0] = 0.0
                x[1, 2, 1] = 6.0e4
                x[1, 3, 2, 5] = np.nan
                k, v = mx.array(x[:1]).astype(dtype), mx.array(x[1:]).astype(dtype)
                name = f"d{d}_{bits[0]}{bits[1]}_{str(dtype).split('.')[-1]}"
                for resident in (False, True):
                    res = cache_append.launch(codec, k, v, resident)
                    mx.eval(res)
                    for i, a in enumerate(res):
                        out[f"{name}_plain{int(resident)}_{i}"] = np.array(a.view(mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a)
                    kb, vb = _buffers(codec, 8), _buffers(codec, 8)  # each its own memory: the kernel writes them
                    if not resident:  # the copy role too: old buffers' first 2 tokens, then the new ones
                        c = cache_append.launch_copy(codec, k, v, kb, vb, 2, 16)
                        mx.eval(c)
                        for i, a in enumerate(c):
                            # positions [0, n + t): the rest of the new buffers is never written
                            out[f"{name}_copy_{i}"] = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)[:, :, :5]
                    r = cache_append.launch_inplace(codec, k, v, kb, vb, mx.array([2], mx.uint32), resident)
                    mx.eval(r)
                    r = r if resident else (r,)
                    for i, a in enumerate(tuple(r) + kb + vb):
                        out[f"{name}_inplace{int(resident)}_{i}"] = np.array(a.view(mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a)
    np.savez(path, **out)
    print(f"{len(out)} arrays -> {path}")


def compare(a: str, b: str) -> int:
    x, y = np.load(a), np.load(b)
    if sorted(x.files) != sorted(y.files):
        print("different arrays:", sorted(set(x.files) ^ set(y.files)))
        return 1
    bad = [f for f in x.files if x[f].shape != y[f].shape or x[f].tobytes() != y[f].tobytes()]
    for f in bad:
        print("differs:", f)
    print(f"{len(x.files) - len(bad)} of {len(x.files)} arrays bit-identical")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--compare", action="store_true")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.paths)
    sys.path.insert(0, str(Path.cwd()))
    dump(a.paths[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
