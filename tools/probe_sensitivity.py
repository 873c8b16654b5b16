"""Measure the token-KL sensitivity of every (layer, side) slot of a model's KV cache.

Each probe quantizes one layer (keys and values) with RVQ 2+1, everything else exact, and scores
the second half of each tuning text (``half`` protocol); two more probes quantize all keys, then all
values. A slot's sensitivity is its layer's, split between keys and values in the ratio of the two
side probes (one probe per slot would cost twice the runs, which this 2-core machine cannot spare).
Writes a JSON profile ``{"slots": {"L:k": kl, ...}}`` that the evaluation's allocation uses.
``--sink 1 --center-keys``: every probe runs with that codec state (the first token exact, a per-head
key mean taken out before coding), so the profile weighs slots as a cache with that state codes them.

    python tools/probe_sensitivity.py [--model PATH] [--tokens 512] [--sink 1 --center-keys] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quality import methods as M  # noqa: E402
from quality import protocol as P  # noqa: E402
from quality.allocate import PROBE  # noqa: E402
from quality.texts import DEFAULT_TEXTS, load_tokens, text_from_arg  # noqa: E402


def write_profile(args, texts, side_kl: dict, layer_kl: list) -> None:
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    share_k = mean(side_kl["k"]) / (mean(side_kl["k"]) + mean(side_kl["v"]))
    slots = {}
    for l in range(len(layer_kl)):
        slots[f"{l}:k"] = mean(layer_kl[l]) * share_k
        slots[f"{l}:v"] = mean(layer_kl[l]) * (1 - share_k)
    out = {"probe": list(PROBE), "tokens": args.tokens, "texts": [t.name for t in texts],
           "sink": args.sink, "center_keys": args.center_keys,
           "model": args.model or "bundled SmolLM2-135M-Instruct", "share_k": share_k,
           "side_kl": side_kl, "layer_kl": layer_kl, "slots": slots}
    Path(args.out).write_text(json.dumps(out, indent=1), encoding="utf-8")


def main(argv=None) -> int:
    from rvqstore.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", action="append", default=None, help="tuning text (repeat); default: the bundled three")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sink", type=int, default=0, help="probe with this many first tokens exact (codec state)")
    ap.add_argument("--center-keys", action="store_true", help="probe with the per-head key mean taken out (codec state)")
    args = ap.parse_args(argv)
    state = {"sink": args.sink, "center_keys": args.center_keys}
    from rvqstore.model import load_model

    model, tok = load_model(args.model)
    texts = [text_from_arg(a) for a in args.text] if args.text else [t for t in DEFAULT_TEXTS if not t.held_aside]
    if any(t.held_aside for t in texts):
        raise SystemExit("a held-aside text must not be used to tune")
    n_layers = len(model.layers)
    q = M.rvq(PROBE, model.layers[0].self_attn.head_dim if hasattr(model.layers[0].self_attn, "head_dim") else 64)
    exact = M.Quantizer("exact", 32.0, lambda x: x)
    layer_kl: list[list[float]] = [[] for _ in range(n_layers)]
    side_kl: dict[str, list[float]] = {s: [] for s in M.SIDES}
    t0 = time.perf_counter()
    for t in texts:
        ids = load_tokens(tok, t, args.tokens)
        ref = P.reference(model, ids)
        for s in M.SIDES:
            probe = M.Method(f"all {s}", "probe", lambda layer, side, s=s: q if side == s else exact, **state)
            side_kl[s].append(float(P.run_method(model, ids, probe, ref).scores.kl.mean()))
        print(f"[{time.perf_counter() - t0:6.0f}s] {t.name} all K {side_kl['k'][-1]:.4f} all V {side_kl['v'][-1]:.4f}",
              flush=True)
        for l in range(n_layers):
            probe = M.Method(f"layer {l}", "probe", lambda layer, side, l=l: q if layer == l else exact, **state)
            layer_kl[l].append(float(P.run_method(model, ids, probe, ref).scores.kl.mean()))
            print(f"[{time.perf_counter() - t0:6.0f}s] {t.name} layer {l}: {layer_kl[l][-1]:.4f}", flush=True)
        write_profile(args, texts[:len(side_kl["k"])], side_kl, layer_kl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
