"""``docs/quality.md`` and ``docs/quality.png`` from an evaluation's results dict.

The tables and the plot are generated; the findings (what was decided and why) are hand-written in
``tools/quality/findings.md`` and included as they are, so a re-run refreshes the figures without
rewriting the reasoning (which then has to be re-read against them).
"""

from __future__ import annotations

from pathlib import Path

FINDINGS = Path(__file__).with_name("findings.md")


def _e(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.4f}" if abs(v) >= 1e-3 else f"{v:.1e}"


def _pct(s: dict) -> str:
    return f"{100 * s['ppl_delta']:+.1f}% [{100 * s['ppl_delta_lo']:+.1f}, {100 * s['ppl_delta_hi']:+.1f}]"


def rows_of(res: dict, protocol: str) -> list[dict]:
    return sorted((r for r in res["rows"] if r["protocol"] == protocol), key=lambda r: (r["family"], r["bits"]))


def table(res: dict, protocol: str) -> list[str]:
    tuning = [t["name"] for t in res["texts"] if not t["held_aside"]]
    held = [t["name"] for t in res["texts"] if t["held_aside"]]
    head = ("| method | bits | tok KL (pooled) | Δppl [95% CI] | top-1 = fp32 | K / V err | "
            + " | ".join(f"KL {n}" for n in tuning) + "".join(f" | KL {n} | Δppl {n}" for n in held) + " |")
    out = [head, "|" + "---|" * (6 + len(tuning) + 2 * len(held))]
    for r in rows_of(res, protocol):
        p = r.get("pooled")
        cells = [r["name"], f"{r['bits']:.2f}"]
        cells += [_e(p["tok_kl"]), _pct(p), f"{100 * p['top1_agree']:.1f}%", f"{_e(p['k_err'])} / {_e(p['v_err'])}"] \
            if p else ["–"] * 4
        cells += [_e(r["texts"][n]["tok_kl"]) for n in tuning]
        for n in held:
            cells += [_e(r["texts"][n]["tok_kl"]), _pct(r["texts"][n])]
        out.append("| " + " | ".join(cells) + " |")
    return out


# The goals: (preset, budget bits/coord, token KL at most, Δppl at most or None), and the
# evaluated rows that are those presets (rvqstore.presets without and with the SmolLM2 profile).
GOALS = (("small", 3.0, 0.10, None), ("balanced", 4.5, 0.03, 0.02), ("near-lossless", 6.0, 0.003, None))
PRESET_ROWS = {"small": ("K 2+1 / V 1+1", "RVQ alloc 3"), "balanced": ("K 4+1 / V 2+1", "RVQ alloc 4.5"),
               "near-lossless": ("K 4+2 / V 4+1", "RVQ alloc 6")}


def goals_table(res: dict, protocol: str = "half") -> list[str]:
    """Each preset against its goal, pooled and on the held-aside text, and against every rotated-affine
    row of equal or fewer bits on every text."""
    rows = {r["name"]: r for r in rows_of(res, protocol)}
    held = [t["name"] for t in res["texts"] if t["held_aside"]]
    names = [t["name"] for t in res["texts"]]
    out = ["| preset | as evaluated | bits | tok KL pooled (goal) | Δppl pooled | " + "".join(f"tok KL {h} | Δppl {h} | " for h in held)
           + "goal | ahead of rotated affine at ≤ bits, every text |", "|" + "---|" * (7 + 2 * len(held))]
    for preset, budget, kl_goal, ppl_goal in GOALS:
        for label, name in zip(("per side", "per layer+side (profile)"), PRESET_ROWS[preset]):
            r = rows.get(name)
            if r is None or "pooled" not in r:
                continue
            p = r["pooled"]
            ok = r["bits"] <= budget + 1e-9 and p["tok_kl"] <= kl_goal and (ppl_goal is None or p["ppl_delta"] <= ppl_goal)
            rivals = [x for x in rows.values() if x["family"].startswith("rotated") and x["bits"] <= r["bits"] + 1e-9]
            beaten = [x for x in rivals if all(r["texts"][n]["tok_kl"] < x["texts"][n]["tok_kl"] for n in names)]
            goal = f"≤ {kl_goal:g}" + (f", Δppl ≤ +{100 * ppl_goal:g}%" if ppl_goal else "")
            cells = [f"{preset} ({label})", f"`{name}`", f"{r['bits']:.2f} (≤ {budget:g})", f"{_e(p['tok_kl'])} ({goal})",
                     _pct(p)]
            for h in held:
                cells += [_e(r["texts"][h]["tok_kl"]), _pct(r["texts"][h])]
            cells += ["**met**" if ok else "missed",
                      (f"yes ({len(beaten)} of {len(rivals)})" if len(beaten) == len(rivals) else
                       f"no: behind {', '.join(x['name'] for x in rivals if x not in beaten)}") if rivals else "none at ≤ bits"]
            out.append("| " + " | ".join(cells) + " |")
    return out


def texts_table(res: dict) -> list[str]:
    proto = res["protocols"][0]
    any_row = rows_of(res, proto)[0]
    out = ["| text | file | kept aside | tokens (scored) | perplexity (float32 cache) |", "|---|---|---|---|---|"]
    for t in res["texts"]:
        s = any_row["texts"][t["name"]]
        out.append(f"| {t['name']} | `{t['file']}` | {'yes' if t['held_aside'] else 'no'} | "
                   f"{res['n_tokens']} ({s['n_scored']}) | {s['ppl_ref']:.2f} |")
    return out


def plot(res: dict, path: Path, protocol: str = "half") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["pooled"] + [t["name"] for t in res["texts"]]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), sharey=True)
    rows = rows_of(res, protocol)
    fams = sorted({r["family"] for r in rows})
    cmap = plt.get_cmap("tab10")
    for ax, n in zip(axes, names):
        for i, f in enumerate(fams):
            pts = sorted((r["bits"], (r["pooled"] if n == "pooled" else r["texts"][n])["tok_kl"])
                         for r in rows if r["family"] == f and r["bits"] <= 10)
            if pts:
                marker = "o-" if len(pts) > 1 else "*"
                ax.plot([p[0] for p in pts], [max(p[1], 1e-6) for p in pts], marker, color=cmap(i % 10), label=f,
                        ms=5 if len(pts) > 1 else 12)
        ax.set_yscale("log")
        ax.set_xlabel("stored bits per coordinate")
        ax.set_title(n + (" (tuning texts)" if n == "pooled" else ""))
        ax.grid(alpha=0.3, which="both")
        for y in (0.003, 0.03, 0.10):
            ax.axhline(y, color="grey", lw=0.6, ls=":")
    axes[0].set_ylabel("mean token KL vs float32 cache")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(res: dict) -> str:
    out = ["# Quality per bit: token KL against the unquantized cache, on texts of several kinds", "",
           f"Generated by `tools/eval_quality.py` (model: {res['model']}; {res['n_tokens']} tokens per text, "
           f"the second half scored; float32 on CPU). The plot is `docs/quality.png`: stored bits per "
           "coordinate (everything counted: norms or scales/biases, packing waste, sink tokens) against the mean "
           "token KL of each method, pooled over the tuning texts and per text; dotted lines at the goals' "
           "0.003 / 0.03 / 0.10.", "", "![bits vs token KL](quality.png)", ""]
    if FINDINGS.exists():
        out += [FINDINGS.read_text(encoding="utf-8").rstrip(), ""]
    out += ["## Goals of issue 11", "", "Pooled over the tuning texts; the held-aside text separately. "
            "Bits are stored bits per coordinate at head dim 64 (norms counted, fixed-width codes).", ""]
    out += goals_table(res) + [""]
    out += ["## Texts", ""] + texts_table(res) + [""]
    for proto in res["protocols"]:
        desc = ("first half prefilled in chunks of 512, second half in one pass" if proto == "half" else
                f"the whole text in chunks of {res['chunk']} tokens, the second half scored")
        out += [f"## All methods, protocol `{proto}` ({desc})", "",
                "tok KL = mean over scored tokens of KL(p_float32 ‖ p_method) of the next-token distribution; "
                "pooled = mean of the per-text means over the tuning texts. Δppl pools their tokens; its 95% "
                "interval is a paired moving-block bootstrap (blocks of 32 tokens, resampled within each text). "
                "K / V err = E‖x−x̂‖²/‖x‖² over every cached vector.", ""] + table(res, proto) + [""]
    out += ["## How to reproduce", "", "```",
            "python tools/probe_sensitivity.py --tokens 512 --text prose=tools/texts/prose-genesis-joseph.txt "
            "--out tools/results/quality-sensitivity-smollm2.json",
            *(res.get("recipe") or [f"python tools/eval_quality.py {a}" for a in res.get("argv", "").split("\n")]),
            "```", ""]
    return "\n".join(out)


def write_report(res: dict, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    plot(res, folder / "quality.png", res["protocols"][0])
    (folder / "quality.md").write_text(render(res), encoding="utf-8")
