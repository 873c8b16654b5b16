"""Generation with compressed caches: decode step, tokens/s, peak memory and resume, against mlx-lm's caches.

Arms (each a cache per layer): ``kv`` (mlx-lm KVCache, the model's dtype), ``q4`` (mlx-lm
QuantizedKVCache, 4-bit, group 64; recorded as failing where the backend lacks it), ``packed-2+2``,
``packed-4+2`` (RVQKVCache packed: attention on the codes), ``resident-2+2``, ``resident-4+2``; ``ARM@VARIANT``
(e.g. ``packed-2+2@nofuse``): that arm with its steps run under an attention-kernel variant of
tools/kernel_variants.py, for same-run comparisons (no resume for those).

Model: ``--model smollm2`` (the bundled SmolLM2-135M, float32 on CPU) or ``--model random`` (an
mlx-lm llama of the geometry flags, random weights, ``--dtype``; default Llama-3-8B: 32 layers,
hidden 4096, 32/8 heads, head dim 128, MLP 14336). A step's time depends on the geometry, not on the
weights or on what the cache holds, so caches are filled with random keys/values (unit-variance, in
blocks of 4,096 tokens through ``update_and_fetch``) to each context.

Method: every arm is warmed up (compiles, first-use checks), then rounds interleave the arms; in a
round an arm runs ``--steps`` single-token steps (each evaluated), then ``--stream-tokens`` through
mlx-lm's loop; medians over all steps. An arm ``X@VARIANT`` beside ``X`` is also compared round by round
(:func:`paired`: the median of the per-round differences, and how often the variant was faster). The caches keep growing (by under 256 tokens over a run: no
buffer grows inside the timed steps) as in a real generation; ``--trim-back`` trims them back after
each round instead (a packed cache then copies its buffers once after every trim before it writes in
place again: what a trimming user sees, not a steady decode). Peak memory: the arm's cache bytes (allocated capacity) plus what
its steps allocate on top (``mx.get_peak_memory()`` during the steps minus the memory active before
them); the model's weights are left out. Resume (``--resume``): the arm's caches saved to a file (``.rvq`` for RVQ arms,
mlx-lm's safetensors prompt cache for ``kv``), then load + one token evaluated, median of
``--resume-rounds``.

    python tools/bench_generation.py --model smollm2 --contexts 1024,4096 --json out.json --md out.md
    python tools/bench_generation.py --model random --contexts 1024,8192,32768 --resume ...
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from rvqstore import decode_step, fused  # noqa: E402

ARMS = ("kv", "q4", "packed-2+2", "packed-4+2", "resident-2+2", "resident-4+2")


def add_geometry_args(ap) -> None:
    """The random-weight model's geometry (default: Llama-3-8B), as :func:`build_model` reads it."""
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dtype", default="float16")


def build_model(a):
    if a.model == "smollm2":
        from rvqstore.blas import maybe_reexec_with_openblas

        maybe_reexec_with_openblas()
        from rvqstore.model import load_model

        model, _ = load_model()
        return model, "SmolLM2-135M-Instruct (bundled, float32)"
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=a.hidden, num_hidden_layers=a.layers,
                           intermediate_size=a.intermediate, num_attention_heads=a.heads,
                           num_key_value_heads=a.kv_heads, head_dim=a.head_dim, rms_norm_eps=1e-5,
                           vocab_size=a.vocab, tie_word_embeddings=False, rope_theta=500000.0)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(getattr(mx, a.dtype))
    mx.eval(model.parameters())
    return model, (f"random-weight llama: {a.layers} layers, hidden {a.hidden}, {a.heads}/{a.kv_heads} heads, "
                   f"head dim {a.head_dim}, MLP {a.intermediate}, vocab {a.vocab}, {a.dtype}")


def geometry(model):
    layer = model.layers[0].self_attn
    return len(model.layers), layer.n_kv_heads, model.args.head_dim or model.args.hidden_size // model.args.num_attention_heads


@contextlib.contextmanager
def variant(arm):
    """An arm ``name@variant`` runs its steps under that attention-kernel variant (tools/kernel_variants.py): a
    same-run comparison of kernel settings; a plain arm runs under the modules' settings."""
    name = arm.partition("@")[2]
    if not name:
        yield
        return
    import kernel_variants

    old = kernel_variants.apply(name)
    try:
        yield
    finally:
        kernel_variants.restore(old)


def make_caches(arm, n_layers):
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from rvqstore import RVQKVCache

    arm = arm.partition("@")[0]

    if arm == "kv":
        return [KVCache() for _ in range(n_layers)]
    if arm == "q4":
        return [QuantizedKVCache(group_size=64, bits=4) for _ in range(n_layers)]
    mode, bits = arm.split("-")
    b = tuple(int(x) for x in bits.split("+"))
    return [RVQKVCache(b, mode=mode) for _ in range(n_layers)]


def fill(caches, n, kv_heads, head_dim, dtype):
    for i, c in enumerate(caches):
        mx.random.seed(1000 + i)
        for s in range(0, n, 4096):
            t = min(4096, n - s)
            k = mx.random.normal((1, kv_heads, t, head_dim)).astype(dtype)
            v = mx.random.normal((1, kv_heads, t, head_dim)).astype(dtype)
            c.update_and_fetch(k, v)
        mx.eval([x for x in c.state if x is not None] if isinstance(c.state, (list, tuple)) else c.state)


def step(model, caches, token):
    logits = model(mx.array([[token]], dtype=mx.int32), cache=caches)[:, -1]
    y = mx.argmax(logits, axis=-1)
    mx.eval(y)
    return int(y.item())


def stream(model, caches, token, n, trim_back=False):
    """Milliseconds per token as mlx-lm's own ``generate_step`` streams them: it builds step t+1 while the
    device runs step t (``mx.async_eval``), so host work hides behind device work (``trim_back``: the
    caches trimmed back afterwards); the first gap (it holds the prompt step) is left out."""
    from mlx_lm.generate import generate_step

    before = caches[0].offset
    marks = [time.perf_counter() for _ in generate_step(mx.array([token], dtype=mx.int32), model,
                                                        max_tokens=n + 1, prompt_cache=caches)]
    if trim_back:
        trim(caches, caches[0].offset - before)
    return [(b - a) * 1e3 for a, b in zip(marks[1:], marks[2:])]


def trim(caches, n):
    for c in caches:
        c.trim(n)


def save(arm, caches, path, compress="auto"):
    if arm == "kv":
        from mlx_lm.models.cache import save_prompt_cache

        save_prompt_cache(path, caches)
    else:
        import rvqstore

        rvqstore.save_prompt_cache(path, caches, compress=compress)
    return os.path.getsize(path)


def load(arm, path):
    if arm == "kv":
        from mlx_lm.models.cache import load_prompt_cache

        return load_prompt_cache(path)
    import rvqstore

    return rvqstore.load_prompt_cache(path)


def paired(rows, arm, live) -> None:
    """For an arm ``X@variant`` whose ``X`` ran in the same rounds: the per-round differences of their medians (the
    arms run one after another in every round, their order reversed every other round, so the two share each round's
    host and device conditions, and the spread between rounds drops out of the comparison). ``paired_step_diff_ms``: the median over rounds of this arm's round median less ``X``'s
    (negative: this arm faster); ``paired_step_faster``: the share of rounds it was faster; the same for the stream."""
    base = arm.partition("@")[0]
    if base == arm or base not in live:
        return
    r = rows[arm]
    r["paired_with"] = base
    for what in ("step", "stream"):
        mine, theirs = r[f"round_{what}_ms"], rows[base][f"round_{what}_ms"]
        if mine and len(mine) == len(theirs):
            d = [x - y for x, y in zip(mine, theirs)]
            r[f"paired_{what}_diff_ms"] = statistics.median(d)
            r[f"paired_{what}_faster"] = sum(x < 0 for x in d) / len(d)


def run_context(a, model, n, arms, dtype):
    n_layers, kv_heads, head_dim = geometry(model)
    rows = {}
    caches = {}
    for arm in arms:
        try:
            cs = make_caches(arm, n_layers)
            fill(cs, n, kv_heads, head_dim, dtype)
            with variant(arm):
                step(model, cs, 1)  # warm-up: compiles, kernel first-use checks
                step(model, cs, 2)
                if a.trim_back:
                    trim(cs, 2)
                caches[arm] = cs
                if a.stream_tokens:
                    stream(model, cs, 2, 4, a.trim_back)  # warm-up of mlx-lm's loop
            rows[arm] = {"step_ms": [], "cpu_ms": [], "stream_ms": [], "peak_bytes": 0,
                         "cache_nbytes": int(sum(getattr(c, "nbytes", 0) for c in cs)),
                         "layer_steps": 0, "bound_updates": 0, "folded_attends": 0, "round_step_ms": [],
                         "round_stream_ms": []}
        except Exception as e:  # e.g. QuantizedKVCache on CUDA: no quantized_matmul for this shape
            rows[arm] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            print(f"  {n} {arm}: fails: {rows[arm]['error']}", flush=True)
        gc.collect()
    live = [x for x in arms if x in caches]
    for r in range(a.rounds):
        for arm in (live if r % 2 == 0 else live[::-1]):
            cs = caches[arm]
            mx.synchronize()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            tok = 3 + r
            bound0, fold0 = decode_step.stats["updates"], decode_step.stats["folds"]
            with variant(arm):
                for _ in range(a.steps):
                    mx.synchronize()
                    t0, c0 = time.perf_counter(), time.process_time()
                    tok = step(model, cs, tok % 1000)
                    mx.synchronize()
                    rows[arm]["step_ms"].append((time.perf_counter() - t0) * 1e3)
                    rows[arm]["cpu_ms"].append((time.process_time() - c0) * 1e3)
                rows[arm]["round_step_ms"].append(statistics.median(rows[arm]["step_ms"][-a.steps:]))
                # the timed updates that bound decode steps served (rvqstore.decode_step): a share well below 1 on
                # CUDA means the arm was timed on its regular paths (e.g. a resident cache staging its codes)
                rows[arm]["bound_updates"] += decode_step.stats["updates"] - bound0
                rows[arm]["folded_attends"] += decode_step.stats["folds"] - fold0  # rvqstore.attention.fold
                rows[arm]["layer_steps"] += a.steps * sum(1 for c in cs if hasattr(c, "_decode_step"))
                # this arm's cache plus what its steps allocate on top of everything already held
                transient = mx.get_peak_memory() - before
                rows[arm]["peak_bytes"] = max(rows[arm]["peak_bytes"], rows[arm]["cache_nbytes"] + transient)
                if a.trim_back:
                    trim(cs, a.steps)
                if a.stream_tokens:
                    ms = stream(model, cs, tok % 1000, a.stream_tokens, a.trim_back)
                    rows[arm]["stream_ms"] += ms
                    rows[arm]["round_stream_ms"].append(statistics.median(ms))
    for arm in live:
        if rows[arm]["stream_ms"]:
            rows[arm]["stream_median_ms"] = statistics.median(rows[arm]["stream_ms"])
        del rows[arm]["stream_ms"]
        ms = statistics.median(rows[arm]["step_ms"])
        rows[arm].update(step_median_ms=ms, tokens_per_s=1e3 / ms,
                         step_cpu_median_ms=statistics.median(rows[arm]["cpu_ms"]))
        del rows[arm]["step_ms"], rows[arm]["cpu_ms"]
        steps = rows[arm].pop("layer_steps")
        bound = rows[arm].pop("bound_updates")  # bound steps exist on CUDA only
        rows[arm]["bound_share"] = bound / steps if steps and fused.gpu_backend() == "cuda" else None
        folded = rows[arm].pop("folded_attends")
        rows[arm]["folded_share"] = folded / steps if steps and fused.gpu_backend() == "cuda" else None
    for arm in live:
        paired(rows, arm, live)
    if a.resume:
        # .rvq files with the library default (compress="auto": zstd where it pays) and uncompressed
        files = {}
        with tempfile.TemporaryDirectory(dir=a.tmp) as d:
            for arm in [x for x in live if x == "kv" or (x.startswith("packed") and "@" not in x)]:
                for comp in (("auto",) if arm == "kv" else ("auto", "none")):
                    path = os.path.join(d, f"{arm}-{comp}.{'safetensors' if arm == 'kv' else 'rvq'}")
                    size = save(arm, caches[arm], path, comp)
                    rows[arm]["file_bytes" if comp == "auto" else "file_bytes_raw"] = size
                    files[(arm, comp)] = path
            gc.collect()
            times = {k: [] for k in files}
            for r in range(a.resume_rounds):
                for (arm, comp), path in files.items():
                    mx.synchronize()
                    t0 = time.perf_counter()
                    cs = load(arm, path)
                    step(model, cs, 5)
                    mx.synchronize()
                    times[(arm, comp)].append(time.perf_counter() - t0)
                    del cs
                    gc.collect()
            for (arm, comp), t in times.items():
                rows[arm]["resume_s" if comp == "auto" else "resume_s_raw"] = statistics.median(t)
    for arm in live:
        rows[arm]["peak_over_kv"] = (rows[arm]["peak_bytes"] / rows["kv"]["peak_bytes"]
                                     if "kv" in live and rows["kv"]["peak_bytes"] else None)
        rows[arm]["step_over_kv"] = (rows[arm]["step_median_ms"] / rows["kv"]["step_median_ms"]
                                     if "kv" in live else None)
        rows[arm]["step_minus_kv_ms"] = (rows[arm]["step_median_ms"] - rows["kv"]["step_median_ms"]
                                         if "kv" in live else None)
        if "stream_median_ms" in rows[arm] and "kv" in live and "stream_median_ms" in rows["kv"]:
            rows[arm]["stream_over_kv"] = rows[arm]["stream_median_ms"] / rows["kv"]["stream_median_ms"]
        rows[arm]["cpu_over_kv"] = (rows[arm]["step_cpu_median_ms"] / rows["kv"]["step_cpu_median_ms"]
                                    if "kv" in live and rows["kv"]["step_cpu_median_ms"] else None)
        if "resume_s" in rows[arm] and "kv" in live and "resume_s" in rows["kv"]:
            rows[arm]["resume_speedup_vs_kv"] = rows["kv"]["resume_s"] / rows[arm]["resume_s"]
            if "resume_s_raw" in rows[arm]:
                rows[arm]["resume_speedup_vs_kv_raw"] = rows["kv"]["resume_s"] / rows[arm]["resume_s_raw"]
    del caches
    gc.collect()
    return rows


def markdown(res):
    lines = [f"# Generation benchmark ({res['device']})", "", f"`{res['command']}` — {res['date']}, "
             f"{res['wall_s']:.0f} s wall; mlx {res['mlx']}; model: {res['model']}; batch 1. Medians; ratios "
             "from this one run. Peak = the arm's cache bytes + what its steps allocate on top "
             "(`mx.get_peak_memory()` during the steps minus active memory before them); weights left out.", "",
             "Resume = load the file + one token; `raw` = the .rvq saved with `compress=\"none\"`.", "",
             "CPU ms = process CPU time per step (all threads): a load-robust measure of the work on a shared machine.", "",
             "Stream ms = milliseconds per token in mlx-lm's own `generate_step` loop (step t+1 built while the "
             "device runs step t: what a user of mlx-lm's generate/server sees); step ms = one step built and "
             "evaluated alone; step - kv = the step's excess over `KVCache`'s in ms (issue 9's per-token overhead). "
             "Bound = the share of the timed layer updates that bound decode steps served (CUDA; `rvqstore.decode_step`); "
             "folded = the share whose append the split kernel wrote (`rvqstore.attention.fold`).", "",
             "| context | arm | step ms | tok/s | step / kv | step - kv | bound | folded | stream ms | stream / kv | CPU ms | CPU / kv | peak MiB | peak / kv | cache MiB | file MB | resume s | kv resume / resume | raw: resume s | kv / raw |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda v, p=2: "–" if v is None else f"{v:.{p}f}"  # noqa: E731
    for n, rows in res["contexts"].items():
        for arm, r in rows.items():
            if "error" in r:
                lines.append(f"| {n} | {arm} | fails: {r['error'][:90]} | | | | | | | | | | | | | | | | | |")
                continue
            lines.append(f"| {n} | {arm} | {f(r['step_median_ms'])} | {f(r['tokens_per_s'], 1)} | "
                         f"{f(r.get('step_over_kv'))} | {f(r.get('step_minus_kv_ms'))} | {f(r.get('bound_share'))} | {f(r.get('folded_share'))} | "
                         f"{f(r.get('stream_median_ms'))} | {f(r.get('stream_over_kv'))} | "
                         f"{f(r.get('step_cpu_median_ms'), 1)} | {f(r.get('cpu_over_kv'))} | "
                         f"{r['peak_bytes'] / 2**20:.1f} | {f(r.get('peak_over_kv'))} | "
                         f"{r['cache_nbytes'] / 2**20:.1f} | "
                         f"{f(r['file_bytes'] / 1e6, 1) if 'file_bytes' in r else '–'} | {f(r.get('resume_s'), 3)} | "
                         f"{f(r.get('resume_speedup_vs_kv'))} | {f(r.get('resume_s_raw'), 3)} | "
                         f"{f(r.get('resume_speedup_vs_kv_raw'))} |")
    pairs = [(n, arm, r) for n, rows in res["contexts"].items() for arm, r in rows.items() if "paired_with" in r]
    if pairs:
        lines += ["", "Paired rounds (an arm `X@variant` against `X`, both timed in every round): the median "
                  "over rounds of the difference of the two arms' round medians (negative: the variant faster), and "
                  "the share of rounds the variant was faster.", ""]
        for n, arm, r in pairs:
            parts = [f"{what} {r[f'paired_{what}_diff_ms']:+.2f} ms, faster in {r[f'paired_{what}_faster']:.0%}"
                     for what in ("step", "stream") if f"paired_{what}_diff_ms" in r]
            lines.append(f"- {n} `{arm}` against `{r['paired_with']}`: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "random"), default="smollm2")
    add_geometry_args(ap)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=8,
                    help="tokens per round through mlx-lm's generate_step (0: leave the stream measure out)")
    ap.add_argument("--trim-back", action="store_true", help="trim the caches back after every round")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--resume-rounds", type=int, default=3)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--kernel", default="default", help="attention kernel variant (tools/kernel_variants.py)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/kernel_variants.py
    if a.kernel != "default":
        import kernel_variants
        kernel_variants.apply(a.kernel)
    t0 = time.time()
    model, desc = build_model(a)
    dtype = mx.float32 if a.model == "smollm2" else getattr(mx, a.dtype)
    res = {"device": str(mx.default_device()), "mlx": mx.__version__, "model": desc,
           "command": "python tools/bench_generation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "contexts": {}}
    for n in (int(x) for x in a.contexts.split(",")):
        rows = run_context(a, model, n, [x for x in a.arms.split(",") if x], dtype)
        res["contexts"][str(n)] = rows
        print(json.dumps({n: {k: {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                              for k, v in rows.items()}}), flush=True)
        res["wall_s"] = time.time() - t0
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        if a.md:
            Path(a.md).write_text(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
