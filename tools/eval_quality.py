"""Quality of KV-cache quantization methods on real text, measured so that it generalizes.

For every text and method: the model runs over the text with every key and value it caches passed
through the method (simulated cache; for RVQ exactly what ``RVQKVCache`` stores), and its next-token
distributions on the second half of the text are compared with the unquantized (float32) run:
mean token KL (the primary figure), perplexity change with a 95% block-bootstrap interval, top-1
agreement, and key/value relative error. Figures are given per text and pooled over the tuning
texts; a text kept aside (named ``held...``) is reported separately and never used to choose.

    python tools/eval_quality.py [--model PATH] [--text NAME=FILE ...] [--tokens 512]
        [--protocol half --protocol stream] [--methods rvq,rotated,affine,alloc]
        [--profile tools/results/quality-sensitivity-smollm2.json]
        [--runs tools/results/quality-runs] [--json tools/results/quality-smollm2.json]
        [--out docs] [--from-json FILE]

Runs already in ``--runs`` are reused (a long evaluation resumes). Needs matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quality import catalog  # noqa: E402
from quality import protocol as P  # noqa: E402
from quality.methods import Method  # noqa: E402
from quality.metrics import summarize  # noqa: E402
from quality.store import RunStore  # noqa: E402
from quality.texts import DEFAULT_TEXTS, Text, load_tokens, text_from_arg  # noqa: E402


def _key(model_name: str, t: Text, n_tokens: int, proto: str, chunk: int, m: Method) -> dict:
    return {"model": model_name, "text": t.name, "path": t.path.name, "tokens": n_tokens,
            "protocol": proto, "chunk": chunk if proto == "stream" else 0, "method": m.name}


def evaluate(model: Any, tokenizer: Any, texts: Sequence[Text], methods: Sequence[Method], *, n_tokens: int,
             protocols: Sequence[str] = ("half",), chunk: int = 128, store: RunStore | None = None,
             model_name: str = "bundled", stored_only: bool = False, log: Callable[[str], None] = print) -> dict:
    """Every method on every text under every protocol; returns the results dict of the report.
    ``stored_only``: report only the (method, protocol) pairs whose runs are all in ``store``."""
    store = store or RunStore(None)
    n_layers = len(model.layers)
    rows = []
    for proto in protocols:
        chosen = methods
        if stored_only:
            def stored(m: Method) -> bool:
                return all(store.get(_key(model_name, t, n_tokens, proto, chunk, m)) is not None for t in texts)

            chosen = [m for m in methods if stored(m)]
            for m in methods:
                if m not in chosen:
                    log(f"{proto} {m.name}: not all runs stored, left out")
        per = {m.name: {} for m in chosen}
        for t in texts:
            ids = load_tokens(tokenizer, t, n_tokens)
            ref = None
            for m in chosen:
                key = _key(model_name, t, n_tokens, proto, chunk, m)
                run = store.get(key)
                if run is None:
                    if ref is None:
                        ref = P.reference(model, ids, proto, chunk)
                    t0 = time.perf_counter()
                    run = P.run_method(model, ids, m, ref, proto, chunk)
                    store.put(key, run)
                    log(f"{proto} {t.name} {m.name}: tok KL {run.scores.kl.mean():.4f} "
                        f"({time.perf_counter() - t0:.0f}s)")
                per[m.name][t.name] = run
        for m in chosen:
            runs = per[m.name]
            tuning = [t for t in texts if not t.held_aside]
            row = {"name": m.name, "family": m.family, "protocol": proto,
                   "bits": m.bits(n_layers, n_tokens), "texts": {}}
            for t in texts:
                r = runs[t.name]
                row["texts"][t.name] = {**summarize([r.scores]), "k_err": r.k_err, "v_err": r.v_err}
            if tuning:
                row["pooled"] = summarize([runs[t.name].scores for t in tuning])
                row["pooled"]["k_err"] = sum(runs[t.name].k_err for t in tuning) / len(tuning)
                row["pooled"]["v_err"] = sum(runs[t.name].v_err for t in tuning) / len(tuning)
            rows.append(row)
    return {"rows": rows, "texts": [{"name": t.name, "file": t.path.name, "held_aside": t.held_aside} for t in texts],
            "n_tokens": n_tokens, "n_layers": n_layers, "protocols": list(protocols), "chunk": chunk,
            "model": model_name, "machine": f"{platform.machine()} {platform.system()}"}


def merge(parts: Sequence[dict]) -> dict:
    """One results dict from several evaluations of the same texts and length (rows appended;
    protocols in first-seen order)."""
    res = dict(parts[0])
    for p in parts[1:]:
        if (p["texts"], p["n_tokens"], p["model"]) != (res["texts"], res["n_tokens"], res["model"]):
            raise SystemExit("--from-json files differ in texts, length or model")
        res["rows"] = res["rows"] + p["rows"]
        res["protocols"] = list(dict.fromkeys(res["protocols"] + p["protocols"]))
        if "stream" in p["protocols"]:  # the chunk only describes the stream protocol
            res["chunk"] = p["chunk"]
        res["argv"] = res.get("argv", "") + "\n" + p.get("argv", "")
    return res


def main(argv: Sequence[str] | None = None) -> int:
    from rvqstore.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file or mlx-lm folder (default: the bundled SmolLM2)")
    ap.add_argument("--text", action="append", default=None,
                    help="NAME=FILE or FILE, repeatable; a NAME starting with 'held' is kept aside "
                         "(default: tools/texts, see its NOTICE.md)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per text (the second half is scored)")
    ap.add_argument("--protocol", action="append", choices=P.PROTOCOLS, default=None)
    ap.add_argument("--chunk", type=int, default=128, help="chunk of the stream protocol")
    ap.add_argument("--methods", default="rvq,rotated,affine", help="comma-separated groups: "
                    "rvq, rotated, affine, fp16, variants, sides, sides+, alloc")
    ap.add_argument("--only", default=None, help="comma-separated method names to keep from the groups")
    ap.add_argument("--profile", default=None, help="slot sensitivities for the alloc group")
    ap.add_argument("--runs", default=None, help="folder of per-run results to reuse and extend")
    ap.add_argument("--stored-only", action="store_true",
                    help="report only methods whose runs are all in --runs (nothing is computed)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--out", default=None, help="folder for quality.md and quality.png")
    ap.add_argument("--from-json", action="append", default=None,
                    help="re-render from earlier --json files (repeatable: their rows and protocols are merged)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    if args.from_json:
        parts = [json.loads(Path(f).read_text(encoding="utf-8")) for f in args.from_json]
        res = merge(parts)
    else:
        from rvqstore.model import load_model

        model, tokenizer = load_model(args.model)
        texts = [text_from_arg(a) for a in args.text] if args.text else list(DEFAULT_TEXTS)
        profile = catalog.load_profile(args.profile) if args.profile else None
        dim = model.layers[0].self_attn.k_proj.weight.shape[0] // model.args.num_key_value_heads
        methods = [m for g in args.methods.split(",") for m in catalog.group(g.strip(), dim=dim, profile=profile)]
        if args.only:
            keep = {n.strip() for n in args.only.split(",")}
            methods = [m for m in methods if m.name in keep]
            if len(methods) != len(keep):
                raise SystemExit(f"--only names not in the groups: {sorted(keep - {m.name for m in methods})}")
        res = evaluate(model, tokenizer, texts, methods, n_tokens=args.tokens, protocols=args.protocol or ["half"],
                       chunk=args.chunk, store=RunStore(Path(args.runs) if args.runs else None),
                       model_name=args.model or "bundled SmolLM2-135M-Instruct", stored_only=args.stored_only,
                       log=log)
        res["argv"] = " ".join(sys.argv[1:] if argv is None else argv)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1), encoding="utf-8")
    if args.out:
        from quality.report import write_report

        write_report(res, Path(args.out))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
