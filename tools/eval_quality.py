"""Quality of KV-cache quantization methods on real text, measured so that it generalizes.

For every text and method: the model runs over the text with every key and value it caches passed
through the method (simulated cache; for RVQ exactly what ``RVQKVCache`` stores), and its next-token
distributions on the second half of the text are compared with the unquantized (float32) run:
mean token KL (the primary figure), perplexity change with a 95% block-bootstrap interval, top-1
agreement, and key/value relative error; and bits per coordinate ON DISK, measured by saving the
cached half as a real file (``quality.disk_bits``). Figures are given per text and pooled over the
tuning texts; a text kept aside (named ``held...``) is reported separately and never used to choose.
``--fit 3,4.5,6`` finds the allocation's fixed-width target that lands at each on-disk budget;
``--fit-grid 3,4.5,6`` the steps of uniform grids (entropy-coded: ``compress="best"``) that do.

    python tools/eval_quality.py [--model PATH] [--text NAME=FILE ...] [--tokens 512]
        [--protocol half --protocol stream] [--methods rvq,rotated,affine,alloc]
        [--profile tools/results/quality-sensitivity-smollm2.json]
        [--runs tools/results/quality-runs] [--json tools/results/quality-smollm2.json]
        [--out docs] [--from-json FILE [--attach-disk] [--precise-json FILE]] [--fit BUDGETS]
        [--grid-sides K:V,... --grid-scales S,...] [--fit-grid BUDGETS [--grid-key-ratio 0.38] [--sink 1 --center-keys]]

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
from quality.disk_bits import AFFINE_MODES, bits_on_disk, file_form, state_measured, summarize_disk  # noqa: E402
from quality.methods import Method  # noqa: E402
from quality.metrics import summarize  # noqa: E402
from quality.store import RunStore  # noqa: E402
from quality.texts import DEFAULT_TEXTS, Text, load_tokens, text_from_arg  # noqa: E402


def _key(model_name: str, t: Text, n_tokens: int, proto: str, chunk: int, m: Method) -> dict:
    return {"model": model_name, "text": t.name, "path": t.path.name, "tokens": n_tokens,
            "protocol": proto, "chunk": chunk if proto == "stream" else 0, "method": m.name}


def _disk_key(model_name: str, t: Text, n_tokens: int, m: Method) -> dict:
    key = {"model": model_name, "text": t.name, "path": t.path.name, "tokens": n_tokens, "method": m.name, "disk": 1}
    if not state_measured(m):  # codec state estimated before the cache held it: never mistaken for a real file
        key["estimated"] = 1
    return key


def disk_bits(model: Any, tokenizer: Any, t: Text, ids: list[int], m: Method, n_tokens: int, store: RunStore,
              model_name: str, modes: Sequence[str], stored_only: bool) -> dict[str, float] | None:
    """On-disk bits per coordinate of ``m`` saving the cached half of ``ids`` (stored ones reused):
    {compress mode: bits} for RVQ, {"raw"/"zstd": bits} for affine; None when it has no file form."""
    if file_form(m, len(model.layers)) is None:
        return None
    key = _disk_key(model_name, t, n_tokens, m)
    have = store.get_disk(key)
    want = [x for x in modes if x] if file_form(m, len(model.layers)) == "rvq" else list(AFFINE_MODES)
    missing = [x for x in want if x not in have]
    if missing and not stored_only:
        have.update(bits_on_disk(model, tokenizer, ids[:n_tokens // 2], m, missing))
        store.put_disk(key, have)
    return have or None


def evaluate(model: Any, tokenizer: Any, texts: Sequence[Text], methods: Sequence[Method], *, n_tokens: int,
             protocols: Sequence[str] = ("half",), chunk: int = 128, store: RunStore | None = None,
             model_name: str = "bundled", stored_only: bool = False, log: Callable[[str], None] = print,
             disk_modes: Sequence[str] = ("none", "auto")) -> dict:
    """Every method on every text under every protocol; returns the results dict of the report.
    ``stored_only``: report only the (method, protocol) pairs whose runs are all in ``store``.
    ``disk_modes``: the compress modes whose on-disk bits are measured for RVQ methods."""
    store = store or RunStore(None)
    n_layers = len(model.layers)
    disk: dict[str, dict[str, dict]] = {}
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
                if t.name not in disk.get(m.name, {}):
                    d = disk_bits(model, tokenizer, t, ids, m, n_tokens, store, model_name, disk_modes, stored_only)
                    if d is not None:
                        disk.setdefault(m.name, {})[t.name] = d
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
            if m.name in disk:
                row["disk"] = summarize_disk(disk[m.name], [t.name for t in tuning])
                if not state_measured(m):
                    row["disk"]["estimated"] = True
            rows.append(row)
    return {"rows": rows, "texts": [{"name": t.name, "file": t.path.name, "held_aside": t.held_aside} for t in texts],
            "n_tokens": n_tokens, "n_layers": n_layers, "protocols": list(protocols), "chunk": chunk,
            "model": model_name, "machine": f"{platform.machine()} {platform.system()}"}


def attach_disk(res: dict, model: Any, tokenizer: Any, texts: Sequence[Text], methods: Sequence[Method],
                store: RunStore, modes: Sequence[str], log: Callable[[str], None] = print) -> dict:
    """On-disk bits added to the rows of earlier results (``--from-json``) whose names are among
    ``methods``; the token KL figures stay as they were (the runs are deterministic)."""
    by_name = {m.name: m for m in methods}
    tuning = [t.name for t in texts if not t.held_aside]
    if [t.name for t in texts] != [t["name"] for t in res["texts"]]:
        raise SystemExit("--attach-disk: the texts differ from those of the results")
    disk: dict[str, dict] = {}
    for t in texts:
        ids = load_tokens(tokenizer, t, res["n_tokens"])
        for name, m in by_name.items():
            if any(r["name"] == name for r in res["rows"]):
                d = disk_bits(model, tokenizer, t, ids, m, res["n_tokens"], store, res["model"], modes, False)
                if d is not None:
                    disk.setdefault(name, {})[t.name] = d
                    log(f"{t.name} {name}: on disk {d}")
    for r in res["rows"]:
        if r["name"] in disk:
            r["disk"] = summarize_disk(disk[r["name"]], tuning)
    return res


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


def fit_budgets(args: argparse.Namespace, model: Any, tokenizer: Any, texts: Sequence[Text], profile: dict | None,
                dim: int, log: Callable[[str], None]) -> int:
    """``--fit``: the allocation target per on-disk budget, measured on the tuning texts' cached halves."""
    from quality.fit import fit_target

    if profile is None:
        raise SystemExit("--fit needs --profile")
    halves = [load_tokens(tokenizer, t, args.tokens)[:args.tokens // 2] for t in texts if not t.held_aside]
    fits = [fit_target(model, tokenizer, halves, profile, float(b), dim=dim, log=log) for b in args.fit.split(",")]
    out = {"tokens": args.tokens, "cached_tokens": args.tokens // 2, "texts": [t.name for t in texts if not t.held_aside],
           "profile": args.profile, "fits": fits, "argv": " ".join(sys.argv[1:])}
    for f in fits:
        log(f"budget {f['budget']:g} on disk: fixed-width target {f['target']:.2f} ({', '.join(f'{x:.3f}' for x in f['disk'])})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


def fit_grids(args: argparse.Namespace, model: Any, tokenizer: Any, texts: Sequence[Text], profile: dict | None,
              dim: int, log: Callable[[str], None]) -> int:
    """``--fit-grid``: per on-disk budget (files saved with compress="best"), the value step of the
    per-side grid (keys at ``--grid-key-ratio`` of it) and, with a profile, the allocation's scale."""
    from quality import methods as M
    from quality.allocate import allocate_steps
    from quality.fit import fit_grid

    from quality.disk_bits import state_measured

    halves = [load_tokens(tokenizer, t, args.tokens)[:args.tokens // 2] for t in texts if not t.held_aside]
    ratio = args.grid_key_ratio
    state = {"sink": args.sink, "center_keys": args.center_keys}

    def with_state(m: Method) -> Method:  # the codec state (sink tokens, key mean), counted in the files
        return M.variant(m, **state) if args.sink or args.center_keys else m

    out = {"tokens": args.tokens, "cached_tokens": args.tokens // 2, "texts": [t.name for t in texts if not t.held_aside],
           "profile": args.profile, "key_ratio": ratio, **state, "sides": [], "alloc": [], "argv": " ".join(sys.argv[1:])}
    # first guesses from the study (tools/results/quality-ecsq-study.md): value step / scale per budget
    guess = {3.0: (0.96, 0.42), 4.5: (0.31, 0.145), 6.0: (0.12, 0.05)}
    if args.guess:
        guess = {float(b): tuple(float(x) for x in g.split(":"))
                 for b, g in zip(args.fit_grid.split(","), args.guess.split(","))}
    for b in (float(x) for x in args.fit_grid.split(",")):
        g = guess.get(b, (0.3, 0.3))
        side = fit_grid(model, tokenizer, halves, lambda v: with_state(M.grid_per_side(float(f"{v * ratio:.4g}"), v,
                                                                                       "grid per side", dim=dim)),
                        b, g[0], log=log)
        side["key_step"], side["value_step"] = float(f"{side['param'] * ratio:.4g}"), side["param"]
        side["measured"] = state_measured(with_state(M.grid_per_side(1.0, 1.0, "x", dim=dim)))
        out["sides"].append(side)
        log(f"budget {b:g}: grid K s{side['key_step']:g} / V s{side['value_step']:g} -> {max(side['disk']):.3f}")
        if profile is not None:
            al = fit_grid(model, tokenizer, halves, lambda c: with_state(M.grid_allocated(
                allocate_steps(profile, c), f"grid alloc {c:g}", "grid allocated", dim=dim)), b, g[1], log=log)
            al["measured"] = side["measured"]
            out["alloc"].append(al)
            log(f"budget {b:g}: grid alloc {al['param']:g} -> {max(al['disk']):.3f}")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    return 0


def _dim(model: Any) -> int:
    return model.layers[0].self_attn.k_proj.weight.shape[0] // model.args.num_key_value_heads


def _methods(args: argparse.Namespace, model: Any) -> list[Method]:
    """The methods of ``--methods`` (groups), narrowed by ``--only``."""
    profile = catalog.load_profile(args.profile) if args.profile else None
    targets = tuple(float(x) for x in args.alloc_targets.split(",")) if args.alloc_targets else catalog.BUDGETS
    sides = tuple(tuple(float(v) for v in p.split(":")) for p in args.grid_sides.split(",")) if args.grid_sides else None
    scales = tuple(float(x) for x in args.grid_scales.split(",")) if args.grid_scales else None
    methods = [m for g in args.methods.split(",")
               for m in catalog.group(g.strip(), dim=_dim(model), profile=profile, targets=targets, grid_sides=sides,
                                      grid_scales=scales)]
    if args.only:
        keep = {n.strip() for n in args.only.split(",")}
        methods = [m for m in methods if m.name in keep]
        if len(methods) != len(keep):
            raise SystemExit(f"--only names not in the groups: {sorted(keep - {m.name for m in methods})}")
    return methods


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
                    "rvq, rotated, affine, fp16, variants, sides, sides+, alloc, alloc+, grid, grid-alloc")
    ap.add_argument("--only", default=None, help="comma-separated method names to keep from the groups")
    ap.add_argument("--profile", default=None, help="slot sensitivities for the alloc group")
    ap.add_argument("--alloc-targets", default=None,
                    help="comma-separated fixed-width averages of the alloc group (default 3,4.5,6)")
    ap.add_argument("--disk-modes", default="none,auto",
                    help="compress modes whose on-disk bits are measured for RVQ methods (best: slow, rANS; '': none)")
    ap.add_argument("--fit", default=None, metavar="BUDGETS",
                    help="comma-separated on-disk budgets: find the allocation's fixed-width target that lands "
                         "at each (tuning texts' cached halves saved with compress=auto); needs --profile")
    ap.add_argument("--grid-sides", default=None, metavar="K:V,...",
                    help="(key step, value step) pairs of the grid group (default: catalog.GRID_SIDES)")
    ap.add_argument("--grid-scales", default=None, help="comma-separated scales of the grid-alloc group")
    ap.add_argument("--fit-grid", default=None, metavar="BUDGETS",
                    help="comma-separated on-disk budgets: fit the per-side grid's steps and (with --profile) the "
                         "grid allocation's scale to each (files saved with compress=best)")
    ap.add_argument("--grid-key-ratio", type=float, default=0.38,
                    help="--fit-grid: key step / value step of the per-side grid (the study's optimum: 0.35-0.4)")
    ap.add_argument("--sink", type=int, default=0,
                    help="--fit-grid: keep this many first tokens exact (codec state, counted in the files)")
    ap.add_argument("--center-keys", action="store_true",
                    help="--fit-grid: subtract a per-head key mean before coding (codec state, counted in the files)")
    ap.add_argument("--guess", default=None, metavar="V:S,...",
                    help="--fit-grid: first (value step, allocation scale) per budget (default: the study's)")
    ap.add_argument("--runs", default=None, help="folder of per-run results to reuse and extend")
    ap.add_argument("--stored-only", action="store_true",
                    help="report only methods whose runs are all in --runs (nothing is computed)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--out", default=None, help="folder for quality.md and quality.png")
    ap.add_argument("--from-json", action="append", default=None,
                    help="re-render from earlier --json files (repeatable: their rows and protocols are merged)")
    ap.add_argument("--attach-disk", action="store_true",
                    help="with --from-json: measure the on-disk bits of its rows named in --methods (no KL re-run)")
    ap.add_argument("--precise-json", default=None,
                    help="with --from-json: results on more tokens (the presets and closest baselines) for the goals table")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    if args.from_json:
        parts = [json.loads(Path(f).read_text(encoding="utf-8")) for f in args.from_json]
        res = merge(parts)
        if args.attach_disk:
            from rvqstore.model import load_model

            model, tokenizer = load_model(args.model)
            texts = [text_from_arg(a) for a in args.text] if args.text else list(DEFAULT_TEXTS)
            methods = _methods(args, model)
            res = attach_disk(res, model, tokenizer, texts, methods, RunStore(Path(args.runs) if args.runs else None),
                              args.disk_modes.split(","), log)
    else:
        from rvqstore.model import load_model

        model, tokenizer = load_model(args.model)
        texts = [text_from_arg(a) for a in args.text] if args.text else list(DEFAULT_TEXTS)
        if args.fit or args.fit_grid:
            profile = catalog.load_profile(args.profile) if args.profile else None
            fit = fit_grids if args.fit_grid else fit_budgets
            return fit(args, model, tokenizer, texts, profile, _dim(model), log)
        methods = _methods(args, model)
        res = evaluate(model, tokenizer, texts, methods, n_tokens=args.tokens, protocols=args.protocol or ["half"],
                       chunk=args.chunk, store=RunStore(Path(args.runs) if args.runs else None),
                       model_name=args.model or "bundled SmolLM2-135M-Instruct", stored_only=args.stored_only,
                       log=log, disk_modes=args.disk_modes.split(","))
        res["argv"] = " ".join(sys.argv[1:] if argv is None else argv)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1), encoding="utf-8")
    if args.out:
        from quality.report import write_report

        precise = json.loads(Path(args.precise_json).read_text(encoding="utf-8")) if args.precise_json else None
        write_report(res, Path(args.out), precise)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
