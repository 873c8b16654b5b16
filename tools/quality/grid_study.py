"""Study: rate on disk vs error of Lloyd–Max and uniform-grid codes on real keys/values (numpy).

The tuning texts' cached halves are prefilled into exact float32 caches; every (layer, side)'s
vectors are rotated and normalized as the codec does (``RVQCodec.rotate``: coordinates ~N(0, 1)).
For each code, per (layer, side): the mean squared error in those coordinates (= the relative error
E||x - x_hat||^2 / ||x||^2) and the rate the file's ``rans`` sections would reach: the empirical
entropy of stage-1 codes per coordinate plus that of stage-2 codes per coordinate (the two stages are
separate sections, each with one table per coordinate), plus the tables' own bytes (16 bits per entry,
64 x 2^bits entries per section: the writer keeps one shared table when that is shorter).

    python tools/quality/grid_study.py --tokens 1024 --json /tmp/grid-study.json
    python tools/quality/grid_study.py --json /tmp/grid-study.json --report   # the tables of the results md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LM = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 3), (4, 4))
STEPS = tuple(0.03 * 1.15 ** k for k in range(31))  # 0.03 .. 2.0
REACH = (3.5, 4.5)  # the grid spans +-reach (in units of the coordinates' standard deviation)


def capture(model, tokenizer, texts, n_tokens: int) -> list[list[dict[str, np.ndarray]]]:
    """Per text, per layer: {"k": y, "v": y} rotated normalized coordinates (vectors, 64) float32."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from quality.texts import load_tokens
    from rvqstore import RVQCodec

    out = []
    for t in texts:
        ids = load_tokens(tokenizer, t, n_tokens)[: n_tokens // 2]
        caches = [KVCache() for _ in model.layers]
        x = mx.array(ids, dtype=mx.int32)[None]
        for s in range(0, x.shape[1], 512):
            mx.eval(model(x[:, s:s + 512], cache=caches))
        per = []
        for c in caches:
            d = {}
            for side, arr in (("k", c.keys), ("v", c.values)):
                a = arr[:, :, : c.offset].astype(mx.float32)
                codec = RVQCodec(a.shape[-1], (2, 2))
                y, _ = codec.rotate(a)
                d[side] = np.array(y).reshape(-1, a.shape[-1])
            per.append(d)
        out.append(per)
    return out


def _entropy_per_coord(idx: np.ndarray, levels: int) -> tuple[float, float]:
    """(bits per symbol with per-coordinate tables incl. table bytes, same with one table) -> min."""
    n, dim = idx.shape
    counts = np.zeros((dim, levels))
    np.add.at(counts, (np.broadcast_to(np.arange(dim), idx.shape), idx), 1)
    p = counts / n
    with np.errstate(divide="ignore", invalid="ignore"):
        h_coord = -np.nansum(np.where(p > 0, p * np.log2(p), 0.0), axis=1).mean()
        q = counts.sum(0) / counts.sum()
        h_one = -np.sum(np.where(q > 0, q * np.log2(q), 0.0))
    per_coord = h_coord + dim * levels * 16 / idx.size
    one = h_one + levels * 16 / idx.size
    return min(per_coord, one), h_coord


def lm_code(y: np.ndarray, b1: int, b2: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from rvqstore import RVQCodec

    c = RVQCodec(y.shape[-1], (b1, b2))
    k = np.searchsorted(c._fine_thresholds, y, side="left")  # count of thresholds strictly below
    return c.centroids2.reshape(-1)[k], k >> b2, k & ((1 << b2) - 1)


def grid_code(y: np.ndarray, b1: int, b2: int, step: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    levels = 1 << (b1 + b2)
    k = np.clip(np.floor(y / step + levels / 2), 0, levels - 1).astype(np.int64)
    return (k - (levels - 1) / 2) * step, k >> b2, k & ((1 << b2) - 1)


def measure(y: np.ndarray, yh: np.ndarray, i1: np.ndarray, i2: np.ndarray, b1: int, b2: int) -> dict:
    r1, h1 = _entropy_per_coord(i1, 1 << b1)
    r2, h2 = _entropy_per_coord(i2, 1 << b2) if b2 else (0.0, 0.0)
    return {"mse": float(np.mean((y - yh) ** 2)), "rate": float(r1 + r2), "h": float(h1 + h2)}


def study(caps, steps: dict) -> dict:
    """results[code][layer][side] = {"mse", "rate", "h"} averaged over texts."""
    n_layers = len(caps[0])
    res: dict = {}

    def add(name, fn):
        res[name] = [{s: {} for s in "kv"} for _ in range(n_layers)]
        for l in range(n_layers):
            for s in "kv":
                ms = [fn(per[l][s]) for per in caps]
                res[name][l][s] = {f: float(np.mean([m[f] for m in ms])) for f in ms[0]}

    for b1, b2 in LM:
        add(f"LM {b1}+{b2}", lambda y, b1=b1, b2=b2: measure(y, *lm_code(y, b1, b2), b1, b2))
    for b1, b2 in sorted(steps):
        for st in steps[(b1, b2)]:
            add(f"U {b1}+{b2} s{st:g}", lambda y, b1=b1, b2=b2, st=st: measure(y, *grid_code(y, b1, b2, st), b1, b2))
    return res


# ---- the report: rate vs error per code, and what allocation rule to use -------------------------
def _slots(n_layers: int) -> list[tuple[int, str]]:
    return [(l, s) for l in range(n_layers) for s in "kv"]


def _grid_ladder(res: dict) -> dict[float, str]:
    """step -> the name of its grid with the fewest levels (reach 3.5)."""
    out: dict[float, tuple[int, str]] = {}
    for n in res:
        if n.startswith("U "):
            _, b, st = n.split()
            total, step = sum(map(int, b.split("+"))), float(st[1:])
            if step not in out or total < out[step][0]:
                out[step] = (total, n)
    return {k: v[1] for k, v in sorted(out.items())}


def report(res: dict, sens: dict, e0: float) -> list[str]:
    """Markdown: per-code rates/errors by side, and the predicted token KL (sum over slots of
    sens * err / err(probe)) of allocation rules at equal rate."""
    import math

    from rvqstore.bit_allocation import allocate

    n_layers = len(next(iter(res.values())))
    slots = _slots(n_layers)
    kl = lambda t: sum(sens[k] * res[t[k]][k[0]][k[1]]["mse"] / e0 for k in slots)  # noqa: E731
    rate = lambda t: float(np.mean([res[t[k]][k[0]][k[1]]["rate"] for k in slots]))  # noqa: E731
    side = lambda n, s, f: float(np.mean([res[n][l][s][f] for l in range(n_layers)]))  # noqa: E731
    out = ["| code | K rate | K err | V rate | V err | err / (step^2/12) |", "|---|---|---|---|---|---|"]
    ladder = _grid_ladder(res)
    for n in [n for n in res if n.startswith("LM")] + list(ladder.values()):
        ratio = ""
        if n.startswith("U"):
            st = float(n.split()[2][1:])
            ratio = f"{side(n, 'k', 'mse') / (st * st / 12):.3f}"
        out.append(f"| {n} | {side(n, 'k', 'rate'):.3f} | {side(n, 'k', 'mse'):.2e} | {side(n, 'v', 'rate'):.3f} | "
                   f"{side(n, 'v', 'mse'):.2e} | {ratio} |")

    def lagrangian(names, budget):
        def choose(lam):
            return {k: min(names, key=lambda n: sens[k] * res[n][k[0]][k[1]]["mse"] / e0
                           + lam * res[n][k[0]][k[1]]["rate"]) for k in slots}
        lo, hi = 0.0, 1e3
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if rate(choose(mid)) > budget else (lo, mid)
        return choose(hi)

    steps = list(ladder)
    snap = lambda d: ladder[min(steps, key=lambda s: abs(math.log(s / d)))]  # noqa: E731
    mean = float(np.mean(list(sens.values())))

    def rule(budget):
        lo, hi = 1e-4, 10.0
        choose = lambda c: {k: snap(min(2.0, c / math.sqrt(max(sens[k], 1e-12) / mean))) for k in slots}  # noqa: E731
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if rate(choose(mid)) > budget else (lo, mid)
        return choose(hi)

    def per_side(budget):
        best = None
        for ratio in (0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 1.0):
            lo, hi = 1e-3, 5.0
            choose = lambda c: {k: snap(c * ratio if k[1] == "k" else c) for k in slots}  # noqa: E731
            for _ in range(50):
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if rate(choose(mid)) > budget else (lo, mid)
            t = choose(hi)
            if best is None or kl(t) < best[0]:
                best = (kl(t), ratio, hi, rate(t))
        return best

    lm = [n for n in res if n.startswith("LM")]
    out += ["", "Predicted token KL (sum over slots of sensitivity x error / error of the 2+1 probe) at equal "
            "rate (bits per coordinate of the code sections, rANS tables counted; norms and header not):", "",
            "| rate | LM, Lagrangian over bits | grid, Lagrangian over measured curves | grid, rule scale/sqrt(sens) | "
            "grid per side (best K/V step ratio) |", "|---|---|---|---|---|"]
    for b in (2.8, 2.85, 4.3, 4.35, 5.8, 5.85):
        a, g, r = lagrangian(lm, b), lagrangian(list(ladder.values()), b), rule(b)
        ps = per_side(b)
        out.append(f"| {b} | {kl(a):.4f} ({rate(a):.3f}) | {kl(g):.4f} ({rate(g):.3f}) | {kl(r):.4f} ({rate(r):.3f}) | "
                   f"{ps[0]:.4f} ({ps[3]:.3f}, K/V {ps[1]:g}) |")
    out += ["", "The Lloyd–Max allocations in use (rvqstore.bit_allocation.allocate at the presets' targets):", ""]
    for t in (3.16, 4.74, 6.32):
        a = allocate(sens, t)
        tab = {k: f"LM {a[k][0]}+{a[k][1]}" for k in slots}
        if all(v in res for v in tab.values()):
            out.append(f"- target {t}: rate {rate(tab):.3f}, predicted KL {kl(tab):.4f}")
    return out


def main(argv=None) -> int:
    from rvqstore.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--json", required=True)
    ap.add_argument("--report", action="store_true", help="only print the markdown report of an existing --json")
    ap.add_argument("--profile", default=str(Path(__file__).resolve().parents[1] / "results" /
                                             "quality-sensitivity-smollm2.json"))
    args = ap.parse_args(argv)
    if args.report:
        from rvqstore.bit_allocation import PROBE, _err, load_profile

        print("\n".join(report(json.loads(Path(args.json).read_text(encoding="utf-8")), load_profile(args.profile),
                               _err(PROBE, 64))))
        return 0
    from quality.texts import DEFAULT_TEXTS
    from rvqstore.model import load_model

    model, tok = load_model()
    caps = capture(model, tok, [t for t in DEFAULT_TEXTS if not t.held_aside], args.tokens)
    steps = {}
    for st in STEPS:  # the fewest bits whose grid covers +-reach (clipping rare), stage 1 up to 4 bits
        for reach in REACH:
            total = max(2, min(8, int(np.ceil(np.log2(2 * reach / st)))))
            steps.setdefault((min(4, total), total - min(4, total)), set()).add(round(st, 4))
    res = study(caps, {k: sorted(v) for k, v in steps.items()})
    Path(args.json).write_text(json.dumps(res), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
