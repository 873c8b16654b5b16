"""What the fail-closed model check costs (issue 12, item 4), on the bundled SmolLM2-135M (CPU).

Arms, interleaved round by round in a rotated order, medians from the same run:

- ``fingerprint``: ``model_fingerprint`` in full (sha256 over every weight as float32): what every
  save/load/resume with ``model=`` would pay without a memo;
- ``memo hit``: ``rvqstore.model_check.fingerprint`` when the memo holds the model: the xxh3-128
  digest of the raw parameter bytes that proves no weight changed (the old memo compared array
  identities only, free but blind to ``w[0, 0] += 1``);
- ``geometry probe``: building (not evaluating) a one-token forward over ``model.make_cache()`` to read
  each layer's heads and head dims (memo cleared each round);
- ``resume +model`` / ``resume``: ``rvqstore.resume`` of a 512-token snapshot with and without
  ``model=`` (the check's share of a real resume); each round resumes a different prompt suffix.

    python tools/bench_model_check.py [--rounds 7] [--out tools/results/model-check-cpu.txt]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rvqstore.blas import blas_is_fast, maybe_reexec_with_openblas  # noqa: E402

maybe_reexec_with_openblas()

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from mlx.utils import tree_flatten  # noqa: E402

import rvqstore  # noqa: E402
from rvqstore import model_check  # noqa: E402
from rvqstore.fingerprint import model_fingerprint  # noqa: E402
from rvqstore.generation import prefill  # noqa: E402
from rvqstore.model import load_model  # noqa: E402

TEXT = ROOT / "rvqstore" / "data" / "python_docs_excerpt.txt"
N_TOKENS = 512


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    model, tok = load_model()
    tokens = tok.encode(TEXT.read_text())[: N_TOKENS + 64]
    prompt = tokens[:N_TOKENS]
    weight_mb = sum(a.nbytes for _, a in tree_flatten(model.parameters())) / 1e6
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "p.rvq"
        cache = rvqstore.make_prompt_cache(model, bits=(2, 2))
        prefill(model, prompt, cache)
        rvqstore.save_prompt_cache(path, cache, tokens=prompt, model=model, tokenizer=tok)

        def resume_with_model(r):
            rvqstore.resume(path, prompt + tokens[N_TOKENS + r: N_TOKENS + r + 1], model, tokenizer=tok)

        def resume_without(r):
            rvqstore.resume(path, prompt + tokens[N_TOKENS + r: N_TOKENS + r + 1])

        def probe(r):
            model_check._GEO_MEMO.clear()
            model_check.model_geometry(model)

        arms = {
            "fingerprint": lambda r: model_fingerprint(model, tok),
            "memo hit": lambda r: model_check.fingerprint(model, tok),
            "geometry probe": probe,
            "resume +model": resume_with_model,
            "resume": resume_without,
        }
        for f in arms.values():  # warm-up (fills the memo too)
            f(0)
        times: dict[str, list[float]] = {k: [] for k in arms}
        names = list(arms)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                t = time.perf_counter()
                arms[name](r + 1)
                times[name].append(time.perf_counter() - t)

    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [
        f"model check costs on the bundled SmolLM2-135M ({weight_mb:.0f} MB of float32 weights), "
        f"{platform.machine()} CPU, fast BLAS: {blas_is_fast()}, {args.rounds} rounds, medians (s):",
    ]
    for k, v in med.items():
        lines.append(f"  {k:16s} {v:8.4f}   (min {min(times[k]):.4f}, max {max(times[k]):.4f})")
    lines.append(f"  memo hit / full fingerprint: {med['memo hit'] / med['fingerprint']:.3f}")
    lines.append(f"  resume +model / resume: {med['resume +model'] / med['resume']:.2f} "
                 f"(+{med['resume +model'] - med['resume']:.3f} s for the model check)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
