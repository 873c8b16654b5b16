"""Host cost of one custom CUDA kernel node in MLX, by its number of inputs and the size of its binary.

A decode step on the H200 is host-bound, and a packed layer's custom kernels (the in-place append, the
attention launches) cost more host time per node than MLX's own primitives. MLX's
``mx.fast.precompiled_cuda_kernel`` copies the kernel binary into every node it builds and hashes the binary
at every evaluation (``mlx/backend/cuda/custom_kernel.cpp``), and converts each input on the way in; this
tool separates those costs. A trivial kernel (thread 0 adds one to its first input's first element) is
compiled through rvqstore's kernel cache with ``--inputs`` inputs (all passed, one read) and, with
``--bloat``, an unused second kernel in the same binary that makes it ~N KB larger (what the binary's size
alone costs). For each configuration a chain of ``--nodes`` launches (each takes the previous output as its
first input, so they run one after another, as a model's layers do) is built and then evaluated:

- ``build_us``: Python + MLX building one node (the launch call), per node;
- ``eval_us``: evaluating the chain, per node (MLX's per-node host work plus a ~2 us kernel on the GPU);
- ``-binary`` arms: the same kernel launched with its whole binary rather than by reference
  (:mod:`rvqstore.kernel_ref`; the arm without the suffix);
- reference arms: the same chain of ``mx.add`` (a built-in elementwise primitive) and of
  ``mx.fast.scaled_dot_product_attention`` on a tiny problem.

Arms interleave round by round; medians over ``--rounds``.

    python tools/bench_launch_overhead.py --json tools/results/launch-overhead-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from rvqstore import kernel_cache, kernel_ref  # noqa: E402

BODY = """
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = in0[0] + 1u;
"""


def _bloat_header(kb: int) -> str:
    """An unused kernel of roughly ``kb`` KB of machine code (16-byte instructions, fully unrolled)."""
    if not kb:
        return ""
    n = kb * 1024 // 16 // 2
    return (f'\nextern "C" __global__ void rvq_bloat_{kb}(float* x) {{\n  float a = x[threadIdx.x];\n'
            f"  #pragma unroll\n  for (int i = 0; i < {n}; ++i) a = a * x[(i * 7) & 127] + float(i);\n"
            "  x[threadIdx.x] = a;\n}\n")


def make_launch(n_inputs: int, bloat_kb: int):
    k = kernel_cache.cuda_kernel(name=f"rvq_overhead_{n_inputs}_{bloat_kb}",
                                 input_names=[f"in{i}" for i in range(n_inputs)], output_names=["out"],
                                 source=BODY, header=_bloat_header(bloat_kb), ensure_row_contiguous=True)
    one = mx.zeros((1,), dtype=mx.uint32)
    extra = [mx.zeros((16,), dtype=mx.uint32) for _ in range(n_inputs - 1)]
    mx.eval(one, extra)
    run = k.prepare([], tuple([mx.uint32] * n_inputs), [mx.uint32])
    shapes, grid, tg = [(1,)], (32, 1, 1), (32, 1, 1)

    def launch(x):
        return run([x] + extra, shapes, grid, tg)[0]

    mx.eval(launch(one))  # compile, load, first-use
    entry = k._entries.get(((), tuple([mx.uint32] * n_inputs), (mx.uint32,)))
    size = len(entry[1]) if entry else None
    return launch, one, size


def _with_binary(launch):
    """``launch`` handing MLX the whole binary instead of its reference (rvqstore.kernel_ref)."""
    def run(x):
        kernel_ref.BY_REFERENCE = False
        try:
            return launch(x)
        finally:
            kernel_ref.BY_REFERENCE = True
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", default="4,14")
    ap.add_argument("--bloat", default="0,60", help="KB of unused code added to the binary (comma list)")
    ap.add_argument("--nodes", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from rvqstore import fused

    if fused.gpu_backend() != "cuda":
        raise SystemExit("bench_launch_overhead: needs MLX's CUDA backend (MLX's custom CUDA kernels)")
    arms = {}
    sizes = {}
    for ni in (int(x) for x in a.inputs.split(",")):
        for kb in (int(x) for x in a.bloat.split(",")):
            launch, start, size = make_launch(ni, kb)
            arms[f"kernel-{ni}in-{kb}kb"] = (launch, start)
            sizes[f"kernel-{ni}in-{kb}kb"] = size
            arms[f"kernel-{ni}in-{kb}kb-binary"] = (_with_binary(launch), start)
            sizes[f"kernel-{ni}in-{kb}kb-binary"] = size
    x0 = mx.zeros((1,), dtype=mx.uint32)
    arms["mx.add"] = (lambda x: x + 1, x0)
    q = mx.zeros((1, 4, 1, 64), dtype=mx.float16)
    kv = mx.zeros((1, 1, 16, 64), dtype=mx.float16)
    mx.eval(q, kv, x0)
    arms["sdpa"] = (lambda x: mx.fast.scaled_dot_product_attention(x, kv, kv, scale=0.125), q)
    build = {n: [] for n in arms}
    evals = {n: [] for n in arms}
    for r in range(a.rounds + 1):
        names = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for name in names:
            f, x = arms[name]
            mx.synchronize()
            t0 = time.perf_counter()
            y = x
            for _ in range(a.nodes):
                y = f(y)
            t1 = time.perf_counter()
            mx.eval(y)
            mx.synchronize()
            t2 = time.perf_counter()
            if r:  # round 0 warms up
                build[name].append((t1 - t0) / a.nodes * 1e6)
                evals[name].append((t2 - t1) / a.nodes * 1e6)
    rows = {n: {"build_us": statistics.median(build[n]), "eval_us": statistics.median(evals[n]),
                "binary_bytes": sizes.get(n)} for n in arms}
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "nodes": a.nodes, "rounds": a.rounds,
           "by_reference": kernel_cache.stats["by_reference"],
           "command": "python tools/bench_launch_overhead.py " + " ".join(argv or sys.argv[1:]), "rows": rows}
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
