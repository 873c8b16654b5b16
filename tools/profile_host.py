"""Host time to build one decode step of the CUDA path, per layer, on a CPU with a stand-in CUDA device.

On an H200 a decode step is host-bound: what counts is the Python that builds the lazy graph of a step
(cache update, mlx-lm's attention call through the hook, the launches' arguments). This tool builds
(never evaluates) single-token steps of the CUDA path on this machine: ``fused.gpu_backend`` says
"cuda", the default device counts as the GPU, and only MLX's kernel nodes are stand-ins:

- the fused append / unpack launches go through rvqstore's own launch code and its kernel cache's
  ``CudaKernel.__call__`` (a precompiled entry, as on a machine whose kernel cache is warm) down to
  ``mx.fast.precompiled_cuda_kernel``, which returns preallocated arrays of the output shapes;
- the attention kernel is stubbed at ``rvqstore.attention.kernel.launch`` / ``merge`` (and
  ``kernel_mma.launch`` where the tree has it; that launch code is being rewritten separately): they
  return preallocated arrays of the right shapes.

So nearly every microsecond timed is rvqstore's Python (and MLX's graph building of slices and slice
updates), the stand-ins' own cost is measured and printed (``stub_us``). Arms, stepped in turns (the
order rotates every step): mlx-lm's ``KVCache.update_and_fetch`` + mlx-lm's own
``scaled_dot_product_attention``; ``RVQKVCache`` packed and resident (2+2 bits) ``update_and_fetch`` +
the hook's wrapper (the function mlx-lm's llama calls once rvqstore is installed). With ``--against
TREE`` (a folder holding another copy of the ``rvqstore`` package, e.g. ``git archive`` of an older
commit) its packed and resident arms step beside this tree's, so a before/after is read in one run.

    python tools/profile_host.py --rounds 30
    python tools/profile_host.py --rounds 30 --against /tmp/before --json tools/results/host-build-cpu.json
    python tools/profile_host.py --rounds 15 --context 32768 --against /tmp/before --json tools/results/host-build-cpu.json
    python tools/profile_host.py --profile packed    # cProfile of the packed arm's steps
    python tools/profile_host.py --attention-launches # the attention kernel's launch code timed as well

Each round: ``--steps`` one-token steps over ``--layers`` layers (8 KV heads, 32 query heads, head dim
128, float16, batch 1, no mask: mlx-lm's single-token call) at ``--context`` tokens, then a trim back
and an evaluation of the caches' state outside the timing (``--no-trim``: no trim, the caches keep
growing as in a steady decode; a packed cache copies its buffers once after a trim before it writes in
place again; a resident cache stages its codes, unbound, until it passes where it was, so only ``--no-trim``
shows its bound steps). Round 0 is a warm-up (setups, first uses).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["RVQSTORE_KERNEL_CACHE"] = "off"  # nothing written under ~/.cache; entries are faked below

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models import base as lm_base  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

import rvqstore  # noqa: E402

HQ, HKV, D = 32, 8, 128
SDPA = lm_base.scaled_dot_product_attention  # mlx-lm's own function (imported before any hook)


def load_as(name: str, tree: Path):
    """The ``rvqstore`` package under ``tree``, imported as ``name`` (its imports are relative)."""
    pkg = tree / "rvqstore"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Outputs:
    """Arrays per output signature, made once: what the stand-in kernels hand back."""

    def __init__(self):
        self.made: dict = {}

    def get(self, shapes, dtypes) -> list:
        # keyed by the shapes and the last dtype (the one that differs between configurations here: the
        # decoded outputs' float16/bfloat16; codes are always bfloat16 norms and uint32 words), kept cheap
        key = (tuple(map(tuple, shapes)), dtypes[-1])
        out = self.made.get(key)
        if out is None:
            if len(self.made) > 256:  # with --no-trim the unpack's shape grows every step
                self.made.clear()
            # lazy: an output nothing reads is never evaluated (the unpack's, here); the others are, once
            out = self.made[key] = [mx.zeros(s, d) for s, d in zip(key[0], dtypes)]
        return out


def stand_in(pkg, outputs: Outputs, attention_launches: bool = False) -> None:
    """Enter ``pkg``'s CUDA path on this CPU with kernel nodes that cost ~nothing (module docstring)."""
    from importlib import import_module

    fused = import_module(pkg.__name__ + ".fused")
    kernel_cache = import_module(pkg.__name__ + ".kernel_cache")
    kernel = import_module(pkg.__name__ + ".attention.kernel")
    fused.reset()
    fused.gpu_backend = lambda: "cuda"
    fused._on_gpu = lambda: True
    # the kernel cache's precompiled launch, as on a machine whose cache is warm
    kernel_cache.cache_dir = lambda: Path("/nonexistent-rvqstore-profile")
    kernel_cache.get_binary = lambda tu, func: (func, b"stand-in binary " + func.encode(), "stand-in")
    try:  # launches by reference, where the tree has them: published into a folder of this run's
        kernel_ref = import_module(pkg.__name__ + ".kernel_ref")
    except ImportError:
        pass
    else:
        folder = Path(tempfile.mkdtemp(prefix="rvqstore-profile-ptx-"))
        kernel_ref.mlx_cache_dir = lambda: folder
    kernel_cache.verdict_key = lambda *a: None
    kernel_cache.verdict = lambda key: True  # first uses: "checked on this machine before"
    kernel_cache.record_verdict = lambda *a, **kw: None

    def launch(view, q, n_queries, causal, dialect, *, scale=None):
        bh, rows = q.shape[0] * view.n_kv_heads, q.shape[1] * q.shape[2] // view.n_kv_heads
        return tuple(outputs.get([(bh, 4, rows, view.value_codec.dim), (bh, 4, rows, 2)], [mx.float32] * 2))

    def merge(view, o, ml, shape, dtype, dialect):
        return outputs.get([shape], [dtype])[0]

    if attention_launches:  # --attention-launches: the attention kernel's own launch code timed too
        return
    kernel.launch, kernel.merge = launch, merge
    mma = getattr(kernel, "kernel_mma", None)  # the tensor-core split kernel, where the tree has one
    if mma is not None:
        mma.launch = lambda view, q, n_queries, causal, scale: launch(view, q, n_queries, causal, "cuda")


def precompiled(*, output_shapes, output_dtypes, **kw):
    return STUB_OUTPUTS.get(output_shapes, output_dtypes)


STUB_OUTPUTS = Outputs()


def kv(rng, t: int, dtype=mx.float16):
    return mx.array(rng.standard_normal((1, HKV, t, D)).astype(np.float16)).astype(dtype)


def make_arms(packages: dict, layers: int, context: int) -> dict:
    """name -> (caches, attention function); every cache filled to ``context`` tokens."""
    rng = np.random.default_rng(0)
    fill_k, fill_v = kv(rng, context), kv(rng, context)
    mx.eval(fill_k, fill_v)
    arms = {}
    caches = [KVCache() for _ in range(layers)]
    for c in caches:
        c.update_and_fetch(fill_k, fill_v)
    arms["kv"] = (caches, SDPA)
    for name, pkg in packages.items():
        from importlib import import_module

        hook = import_module(pkg.__name__ + ".attention.hook")
        pkg.attention.install()
        first = pkg.RVQKVCache((2, 2), mode="packed", use_kernels=False)  # fill once on the CPU path
        first.update_and_fetch(fill_k, fill_v)
        mx.eval(first.state)
        held = first.state[:6]
        for mode in ("packed", "resident"):
            caches = []
            for _ in range(layers):  # arrays of its own per layer (slice updates change the array object)
                ks, kc1, kc2, vs, vc1, vc2 = [mx.array(a) for a in held]
                caches.append(pkg.RVQKVCache.from_packed(
                    keys=(ks, kc1, kc2), values=(vs, vc1, vc2), dense_keys=None, dense_values=None,
                    dtype=mx.float16, head_dims=(D, D), bits=(2, 2), mode=mode))
            settle(caches, 0)
            arms[f"{name}-{mode}"] = (caches, hook._wrapper)
    return arms


def step(caches, attend, steps, i, scale, times_u, times_a) -> None:
    q, k, v = steps[i]
    tu = ta = 0.0
    clock = time.perf_counter
    for c in caches:
        t0 = clock()
        keys, values = c.update_and_fetch(k, v)
        t1 = clock()
        attend(q, keys, values, cache=c, scale=scale, mask=None)
        ta += clock() - t1
        tu += t1 - t0
    times_u.append(tu * 1e6)
    times_a.append(ta * 1e6)


def settle(caches, n_steps: int) -> None:
    """Back to the context (outside the timing): trim the round's tokens and evaluate what is held."""
    for c in caches:
        if n_steps:
            c.trim(n_steps)
    mx.eval([c.state for c in caches])
    for c in caches:
        copy = getattr(getattr(c, "_mode", None), "keys", None)
        if copy is not None:
            mx.eval(c._mode.keys, c._mode.values)


def run(packages: dict, layers: int, context: int, rounds: int, n_steps: int, profile: str | None,
        attention_launches: bool = False, trim_back: bool = True) -> dict:
    rng = np.random.default_rng(1)
    steps = [(mx.array(rng.standard_normal((1, HQ, 1, D)).astype(np.float16)), kv(rng, 1), kv(rng, 1))
             for _ in range(n_steps)]
    mx.eval(steps)
    arms = make_arms(packages, layers, context)  # filled on the CPU path, then the CUDA path's stand-ins
    mx.fast.precompiled_cuda_kernel = precompiled
    for pkg in packages.values():
        stand_in(pkg, STUB_OUTPUTS, attention_launches)
    names = list(arms)
    scale = D ** -0.5
    times = {n: ([], []) for n in names}
    prof = cProfile.Profile() if profile else None
    for r in range(rounds + 1):
        for i in range(n_steps):
            k = (r * n_steps + i) % len(names)
            for name in names[k:] + names[:k]:
                caches, attend = arms[name]
                tu, ta = times[name] if r else ([], [])
                if prof is not None and r and name.endswith(profile):
                    prof.enable()
                    step(caches, attend, steps, i, scale, tu, ta)
                    prof.disable()
                else:
                    step(caches, attend, steps, i, scale, tu, ta)
        for name in names:
            settle(arms[name][0], n_steps if trim_back else 0)
    for pkg in packages.values():  # every launch served (none latched off on the stand-ins)
        for mod in ("cache_append", "cache_fetch", "attention.kernel"):
            off = sys.modules[f"{pkg.__name__}.{mod}"].disabled()
            if off:
                raise SystemExit(f"{pkg.__name__}.{mod} latched off: {off}")
    out = {}
    for name in names:
        tu, ta = times[name]
        tot = [a + b for a, b in zip(tu, ta)]
        out[name] = {"update_us_per_layer": round(statistics.median(tu) / layers, 2),
                     "attention_us_per_layer": round(statistics.median(ta) / layers, 2),
                     "step_us_per_layer": round(statistics.median(tot) / layers, 2),
                     "step_ms_32_layers": round(statistics.median(tot) / layers * 32 / 1e3, 3),
                     "steps": len(tot)}
    base = statistics.median([a + b for a, b in zip(*times["kv"])]) / layers
    for name in names:
        out[name]["over_kv_ms_32_layers"] = round((out[name]["step_us_per_layer"] - base) * 32 / 1e3, 3)
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        out["profile"] = s.getvalue()
    return out


def stub_cost(reps: int = 20000) -> float:
    """us per call of the stand-in kernel node (a lookup of preallocated outputs)."""
    shapes, dtypes = [(1, 8, 1), (1, 8, 1, 8), (1, 8, 1, 8)] * 2, [mx.bfloat16, mx.uint32, mx.uint32] * 2
    precompiled(output_shapes=shapes, output_dtypes=dtypes)
    t0 = time.perf_counter()
    for _ in range(reps):
        precompiled(output_shapes=shapes, output_dtypes=dtypes)
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=16, help="one-token steps per round")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--against", type=Path, help="a folder holding another copy of the rvqstore package")
    ap.add_argument("--profile", choices=("packed", "resident"), help="print a cProfile of this arm's steps")
    ap.add_argument("--attention-launches", action="store_true",
                    help="stub the attention kernel at MLX's precompiled launch (its launch code timed) instead "
                         "of at kernel.launch/merge")
    ap.add_argument("--no-trim", action="store_true",
                    help="keep the caches growing (a steady decode) instead of trimming back after each round")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    packages = {}
    if a.against is not None:
        packages["before"] = load_as("rvqstore_against", a.against.resolve())
    packages["this"] = rvqstore
    res = run(packages, a.layers, a.context, a.rounds, a.steps, a.profile, a.attention_launches, not a.no_trim)
    prof = res.pop("profile", None)
    result = {"context": a.context, "layers": a.layers, "rounds": a.rounds, "steps_per_round": a.steps,
              "trimmed_back": not a.no_trim,
              "against": None if a.against is None else str(a.against), "stub_us": round(stub_cost(), 3),
              "attention_stubbed_at": "precompiled launch" if a.attention_launches else "kernel.launch/merge",
              "arms": res}
    print(json.dumps(result, indent=1))
    if prof:
        print(prof)
    if a.json:  # one entry per context: runs at other contexts already in the file are kept
        runs = json.loads(a.json.read_text()).get("runs", {}) if a.json.exists() else {}
        runs[f"{a.context}{'-attention-launches' if a.attention_launches else ''}{'-steady' if a.no_trim else ''}"] = result
        a.json.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
