"""What the fail-closed model check costs, in a running process and in a fresh one.

In-process arms (bundled SmolLM2-135M only), interleaved round by round in a rotated order, medians:

- ``fingerprint``: ``model_fingerprint`` in full (sha256 over every weight as float32);
- ``memo hit``: ``rvqstore.model_check.fingerprint`` when the memo holds the model: the digest of the
  raw parameters that proves no weight changed (``rvqstore.parameter_digest``);
- ``geometry probe``: building (not evaluating) a one-token forward to read each layer's heads and dims;
- ``resume +model`` / ``resume``: ``rvqstore.resume`` of a 512-token snapshot with and without ``model=``.

Fresh-process arms (``--fresh-rounds``; either model): a new Python process builds the model, then times
its first ``rvqstore.model_check.fingerprint`` (what the first save/load/resume with ``model=`` of a
process pays on top of the file's own work), once with an empty weights cache (``no record``: the full
hash) and once with the record the previous process kept (``record kept``), interleaved.

    python tools/bench_model_check.py [--rounds 7] [--out tools/results/model-check-cpu.txt]
    python tools/bench_model_check.py --model random --hidden 2048 --layers 16 --intermediate 8192 \\
        --heads 32 --kv-heads 8 --head-dim 64 --dtype float16 --fresh-rounds 3 --in-process-rounds 0
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from rvqstore.blas import blas_is_fast, maybe_reexec_with_openblas  # noqa: E402

maybe_reexec_with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from mlx.utils import tree_flatten  # noqa: E402

from bench_generation import add_geometry_args, build_model  # noqa: E402

TEXT = ROOT / "rvqstore" / "data" / "python_docs_excerpt.txt"
N_TOKENS = 512


def in_process(rounds: int) -> dict[str, list[float]]:
    import rvqstore
    from rvqstore import model_check
    from rvqstore.fingerprint import model_fingerprint
    from rvqstore.generation import prefill
    from rvqstore.model import load_model

    model, tok = load_model()
    tokens = tok.encode(TEXT.read_text())[: N_TOKENS + 64]
    prompt = tokens[:N_TOKENS]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.rvq"
        cache = rvqstore.make_prompt_cache(model, bits=(2, 2))
        prefill(model, prompt, cache)
        rvqstore.save_prompt_cache(path, cache, tokens=prompt, model=model, tokenizer=tok)

        def probe(r):
            model_check._GEO_MEMO.clear()
            model_check.model_geometry(model)

        arms = {
            "fingerprint": lambda r: model_fingerprint(model, tok),
            "memo hit": lambda r: model_check.fingerprint(model, tok),
            "geometry probe": probe,
            "resume +model": lambda r: rvqstore.resume(path, prompt + tokens[N_TOKENS + r: N_TOKENS + r + 1], model,
                                                       tokenizer=tok),
            "resume": lambda r: rvqstore.resume(path, prompt + tokens[N_TOKENS + r: N_TOKENS + r + 1]),
        }
        for f in arms.values():  # warm-up (fills the memo too)
            f(0)
        times: dict[str, list[float]] = {k: [] for k in arms}
        names = list(arms)
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                t = time.perf_counter()
                arms[name](r + 1)
                times[name].append(time.perf_counter() - t)
    return times


def _child(argv: list[str]) -> None:
    """In the fresh process: build the model, time the first model check, print JSON."""
    a = _parser().parse_args(argv)
    if a.model == "smollm2":
        from rvqstore.model import load_model

        model, tok = load_model()
    else:
        model, tok = build_model(a)[0], None
    from rvqstore import model_check

    t = time.perf_counter()
    model_check.fingerprint(model, tok)
    first = time.perf_counter() - t
    t = time.perf_counter()
    model_check.model_geometry(model)
    print(json.dumps({"first_check_s": first, "geometry_s": time.perf_counter() - t}))


def fresh(a, argv: list[str]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"fresh: no record": [], "fresh: record kept": []}
    kept = tempfile.mkdtemp(prefix="bench-weights-")
    try:
        for r in range(a.fresh_rounds + 1):  # run 0 fills `kept` (and warms the page cache); not counted
            order = ["fresh: record kept", "fresh: no record"] if r % 2 else ["fresh: no record", "fresh: record kept"]
            for arm in order:
                empty = tempfile.mkdtemp(prefix="bench-weights-")
                env = {**os.environ, "RVQSTORE_WEIGHTS_CACHE": kept if arm.endswith("kept") else empty}
                out = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, check=True,
                                     capture_output=True, text=True).stdout
                shutil.rmtree(empty, True)
                if r:
                    times[arm].append(json.loads(out.strip().splitlines()[-1])["first_check_s"])
    finally:
        shutil.rmtree(kept, True)
    return times


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "random"), default="smollm2")
    add_geometry_args(ap)
    ap.add_argument("--rounds", "--in-process-rounds", dest="rounds", type=int, default=7,
                    help="rounds of the in-process arms (bundled model only; 0: leave them out)")
    ap.add_argument("--fresh-rounds", type=int, default=3, help="rounds of the fresh-process arms (0: none)")
    ap.add_argument("--out", type=Path, default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    a = _parser().parse_args(argv)
    model, label = build_model(a)
    weight_mb = sum(x.nbytes for _, x in tree_flatten(model.parameters())) / 1e6
    del model
    times = in_process(a.rounds) if a.rounds and a.model == "smollm2" else {}
    if a.fresh_rounds:
        geometry = ["layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "dtype"]
        times.update(fresh(a, ["--model", a.model] + [x for g in geometry
                                                      for x in (f"--{g.replace('_', '-')}", str(getattr(a, g)))]))
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"model check costs: {label} ({weight_mb:.0f} MB of weights), {platform.machine()} CPU, "
             f"fast BLAS: {blas_is_fast()}, `python tools/bench_model_check.py {' '.join(argv)}`, medians (s):"]
    for k, v in med.items():
        lines.append(f"  {k:20s} {v:8.4f}   (min {min(times[k]):.4f}, max {max(times[k]):.4f}, n {len(times[k])})")
    if "memo hit" in med:
        lines.append(f"  memo hit / full fingerprint: {med['memo hit'] / med['fingerprint']:.3f}")
        lines.append(f"  resume +model / resume: {med['resume +model'] / med['resume']:.2f} "
                     f"(+{med['resume +model'] - med['resume']:.3f} s for the model check)")
    if "fresh: no record" in med:
        lines.append(f"  fresh process, first check: no record / record kept: "
                     f"{med['fresh: no record'] / med['fresh: record kept']:.1f}x")
    text = "\n".join(lines)
    print(text)
    if a.out:  # appended: one file holds the runs of several models
        with open(a.out, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
