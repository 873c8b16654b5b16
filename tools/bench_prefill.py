"""Attention calls with several queries on a packed cache: on the codes, or decode-then-SDPA. The crossover.

A call with ``L`` queries (a prefill chunk, a speculative-decoding verify, a batch of appended tokens) on an
``RVQKVCache`` in packed mode can be served from the codes (``rvqstore.attention.dispatch``: the GPU kernel
where it takes the call, the host formulation on MLX's CPU backend, else the MLX-ops formulation) or by
decoding the cache and running ``mx.fast.scaled_dot_product_attention`` on the decode (what mlx-lm's call
does on the keys and values ``update_and_fetch`` handed out). ``dispatch.MAX_QUERIES_ON_CODES`` chooses
between them by ``L``; this tool measures where the crossover lies.

One layer per call (``--layers`` caches called in turn, as a model's layers read theirs), batch 1, caches
holding ``context`` tokens of random keys/values, the ``L`` queries the last ``L`` positions with the causal
mask mlx-lm passes. Arms, interleaved (the order rotates every round), queries rotating among 4 sets:

- ``codes``: ``RVQKVCache.attend_on_codes`` with dispatch's limits lifted (``MAX_QUERIES_ON_CODES``,
  ``MIN_TOKENS_FOR_OPS_CUDA``): the formulation dispatch picks then, ``path`` in each row says which;
- ``decode+sdpa``: ``keys_and_values()`` (the cache's decode) then mlx's fused SDPA with ``mask="causal"``;
- ``chosen``: what a model's call gets with dispatch's settings (the codes where it serves, else decode+sdpa;
  ``chosen`` in each row says which);
- ``fp16-sdpa``: SDPA on fp16 keys/values of the same length (what mlx-lm's KVCache pays; for scale).

Each sample builds ``--k`` calls and evaluates them with one sync (build and evaluation timed together),
divided by ``k``; medians over
``--rounds`` (round 0 is a warm-up). ``codes / decode`` < 1 means the codes win.

    python tools/bench_prefill.py --geometry 9,3,64 --bits 4+2 --contexts 512,2048 --json tools/results/prefill-cpu.json
    python tools/bench_prefill.py --contexts 1024,8192,32768 --bits 2+2,4+2 --json out.json     # 8B geometry, GPU

``--model smollm2`` times whole prefills of the bundled model instead (``rvqstore.generation.prefill``, chunks of
``--chunk`` tokens, prompts of ``--contexts`` tokens of the bundled text, repeated):
arms ``kv`` (mlx-lm's KVCache), ``packed-B`` (dispatch as it is) and ``packed-B@decode`` (calls of more than
``MAX_QUERIES_ON_CODES`` queries left to decode-then-SDPA, as dispatch did before the host path took them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from rvqstore import RVQKVCache  # noqa: E402
from rvqstore.attention import dispatch  # noqa: E402


def _path(cache: RVQKVCache, q: mx.array, scale: float) -> str:
    """Which formulation served a call of ``q`` on ``cache`` (for the record): kernel, host, ops or none."""
    served = []
    engines = {"kernel": dispatch.kernel, "host": dispatch.host, "ops": dispatch.ops}
    real = {name: mod.attend for name, mod in engines.items()}

    def spy(name):
        def f(*args, **kw):
            out = real[name](*args, **kw)
            if out is not None:
                served.append(name)
            return out
        return f

    for name, mod in engines.items():
        mod.attend = spy(name)
    try:
        cache.attend_on_codes(q, scale=scale, mask="causal")
    finally:
        for name, mod in engines.items():
            mod.attend = real[name]
    return served[0] if served else "none"


@contextlib.contextmanager
def _limits_lifted():
    """The codes arm: every call offered to the codes, whatever its size (dispatch's limits off, then back)."""
    names = ("MAX_QUERIES_ON_CODES", "MAX_QUERY_BLOCKS_ON_CPU", "MIN_TOKENS_FOR_OPS_CUDA")
    saved = [getattr(dispatch, n) for n in names]
    for n, v in zip(names, (1 << 30, 1 << 30, 0)):
        setattr(dispatch, n, v)
    try:
        yield
    finally:
        for n, v in zip(names, saved):
            setattr(dispatch, n, v)


def _sample(call, qs, k: int, r: int, layers: int) -> float:
    """ms per call: ``k`` calls built (layer after layer) and evaluated, host and device time together (the
    CPU's host formulation does its work while the call is built)."""
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval([call(qs[(r + i) % len(qs)], i % layers) for i in range(k)])
    mx.synchronize()
    return (time.perf_counter() - t0) / k * 1e3


def measure(hq: int, hkv: int, d: int, bits: tuple, n: int, ls: list, layers: int, rounds: int, k: int,
            dtype) -> list:
    mx.random.seed(n)
    scale = d ** -0.5
    caches, dense = [], []
    for _ in range(layers):
        kk = mx.random.normal((1, hkv, n, d)).astype(dtype)
        vv = mx.random.normal((1, hkv, n, d)).astype(dtype)
        mx.eval(kk, vv)
        c = RVQKVCache(bits)
        for s in range(0, n, 4096):  # in blocks, as a chunked prefill fills it
            c.update_and_fetch(kk[:, :, s:s + 4096], vv[:, :, s:s + 4096])
        mx.eval(c.state)
        caches.append(c)
        dense.append((kk, vv))
    rows = []
    for l in ls:
        qs = [mx.random.normal((1, hq, l, d)).astype(dtype) for _ in range(4)]
        mx.eval(qs)

        def codes(q, i):
            with _limits_lifted():
                out = caches[i].attend_on_codes(q, scale=scale, mask="causal")
            if out is None:
                raise SystemExit(f"the cache declined a call of {l} queries")
            return out

        def chosen(q, i):  # what a model's call gets with dispatch's settings
            out = caches[i].attend_on_codes(q, scale=scale, mask="causal")
            return decode(q, i) if out is None else out

        def decode(q, i):
            keys, values = caches[i].keys_and_values()
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask="causal")

        def fp16(q, i):
            keys, values = dense[i]
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask="causal")

        arms = {"codes": codes, "decode+sdpa": decode, "chosen": chosen, "fp16-sdpa": fp16}
        # the two formulations agree on the same cache (a benchmark of a wrong answer measures nothing)
        err = float(mx.max(mx.abs(codes(qs[0], 0).astype(mx.float32) - decode(qs[0], 0).astype(mx.float32))))
        times = {name: [] for name in arms}
        names = list(arms)
        for r in range(rounds + 1):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                t = _sample(arms[name], qs, k, r, layers)
                if r:
                    times[name].append(t)
        med = {name: statistics.median(v) for name, v in times.items()}
        chosen_path = _path(caches[0], qs[0], scale)
        with _limits_lifted():
            path = _path(caches[0], qs[0], scale)
        row = {"context": n, "bits": f"{bits[0]}+{bits[1]}", "queries": l, "path": path,
               "chosen": "decode+sdpa" if chosen_path == "none" else chosen_path,
               "ms": {name: round(v, 4) for name, v in med.items()},
               "codes_over_decode": round(med["codes"] / med["decode+sdpa"], 3),
               "max_abs_diff": err}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def prefill_model(contexts: list, bits_list: list, chunk: int, rounds: int) -> list:
    """Seconds per whole prefill of the bundled SmolLM2 (float32) by arm; same-run ratios to KVCache's."""
    from importlib import resources

    from mlx_lm.models.cache import make_prompt_cache as lm_cache

    import rvqstore
    from rvqstore.generation import prefill
    from rvqstore.model import load_model

    model, tok = load_model()
    text = resources.files("rvqstore").joinpath("data/python_docs_excerpt.txt").read_text(encoding="utf-8")
    ids = tok.encode(text)
    real_host = dispatch.host.attend

    def short_calls_only(view, q, *args, **kw):  # the rule before: long calls decode then SDPA
        return None if q.shape[2] > dispatch.MAX_QUERIES_ON_CODES else real_host(view, q, *args, **kw)

    rows = []
    for n in contexts:
        tokens = (ids * (n // len(ids) + 1))[:n]
        arms = {"kv": (lambda: lm_cache(model), False)}
        for bits in bits_list:
            b = tuple(int(x) for x in bits.split("+"))
            arms[f"packed-{bits}"] = ((lambda b: lambda: rvqstore.make_prompt_cache(model, b))(b), False)
            arms[f"packed-{bits}@decode"] = ((lambda b: lambda: rvqstore.make_prompt_cache(model, b))(b), True)
        times = {name: [] for name in arms}
        names = list(arms)
        for r in range(rounds + 1):
            for name in names[r % len(names):] + names[:r % len(names)]:
                make, old_rule = arms[name]
                cache = make()
                dispatch.host.attend = short_calls_only if old_rule else real_host
                try:
                    t0 = time.perf_counter()
                    prefill(model, tokens, cache, chunk=chunk)
                    dt = time.perf_counter() - t0
                finally:
                    dispatch.host.attend = real_host
                if r:
                    times[name].append(dt)
        med = {name: statistics.median(v) for name, v in times.items()}
        row = {"context": n, "chunk": chunk, "s": {k: round(v, 3) for k, v in med.items()},
               "over_kv": {k: round(v / med["kv"], 3) for k, v in med.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def crossover(rows: list) -> dict:
    """Per (context, bits): the largest query count up to which the codes won at every count measured."""
    out = {}
    for key in sorted({(r["context"], r["bits"]) for r in rows}):
        won = 0
        for r in sorted((r for r in rows if (r["context"], r["bits"]) == key), key=lambda r: r["queries"]):
            if r["codes_over_decode"] >= 1.0:
                break
            won = r["queries"]
        out[f"{key[0]} {key[1]}"] = won
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="32,8,128", help="query heads, KV heads, head dim")
    ap.add_argument("--bits", default="2+2,4+2")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--queries", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dtype", choices=("float16", "float32"), default=None,
                    help="default: float16 on a GPU, float32 on the CPU (fp16 matmul is slow there)")
    ap.add_argument("--model", choices=("smollm2",), help="whole prefills of the bundled model (see above)")
    ap.add_argument("--chunk", type=int, default=512, help="with --model: prefill chunk, tokens")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if mx.default_device() == mx.cpu:  # MLX's CPU matmuls on OpenBLAS, as rvqstore's CLI runs them
        from rvqstore.blas import maybe_reexec_with_openblas

        maybe_reexec_with_openblas()
    if a.model:
        t0 = time.time()
        rows = prefill_model([int(x) for x in a.contexts.split(",")], a.bits.split(","), a.chunk, a.rounds)
        result = {"device": str(mx.default_device()), "mlx": mx.__version__, "model": "SmolLM2-135M-Instruct (bundled, float32)",
                  "rounds": a.rounds, "command": "python tools/bench_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": round(time.time() - t0, 1),
                  "rows": rows}
        if a.json:
            a.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    hq, hkv, d = (int(x) for x in a.geometry.split(","))
    if hq % hkv or min(hq, hkv, d, a.layers, a.rounds, a.k) < 1:
        raise SystemExit("bad geometry or counts")
    on_gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, a.dtype or ("float16" if on_gpu else "float32"))
    rows = []
    t0 = time.time()
    for n in (int(x) for x in a.contexts.split(",")):
        for bits in a.bits.split(","):
            rows += measure(hq, hkv, d, tuple(int(x) for x in bits.split("+")), n,
                            [int(x) for x in a.queries.split(",")], a.layers, a.rounds, a.k, dtype)
    result = {"device": str(mx.default_device()), "mlx": mx.__version__, "geometry": [hq, hkv, d],
              "dtype": str(dtype), "layers": a.layers, "rounds": a.rounds, "k": a.k,
              "command": "python tools/bench_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": round(time.time() - t0, 1),
              "rows": rows, "codes_win_up_to_queries": crossover(rows)}
    print(json.dumps(result["codes_win_up_to_queries"], indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
