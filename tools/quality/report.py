"""``docs/quality.md`` and ``docs/quality.png`` from an evaluation's results dict.

The tables and the plot are generated; the findings (what was decided and why) are hand-written in
``tools/quality/findings.md`` and included as they are, so a re-run refreshes the figures without
rewriting the reasoning (which then has to be re-read against them).
"""

from __future__ import annotations

from pathlib import Path

from .disk_bits import on_disk

FINDINGS = Path(__file__).with_name("findings.md")


def _e(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.4f}" if abs(v) >= 1e-3 else f"{v:.1e}"


def _pct(s: dict) -> str:
    return f"{100 * s['ppl_delta']:+.1f}% [{100 * s['ppl_delta_lo']:+.1f}, {100 * s['ppl_delta_hi']:+.1f}]"


def _disk_cell(r: dict) -> str:
    """On-disk bits pooled over the tuning texts: auto (affine: zstd), and best where measured
    (affine: codes also through our rANS coder's size), like for like."""
    d, b = on_disk(r), on_disk(r, "best")
    if d is None:
        return "–"
    return _est(r) + f"{d:.2f}" + (f" / {b:.2f}" if b is not None else "")


def _est(r: dict) -> str:
    """"≈" before on-disk figures estimated for codec state the cache did not hold yet (disk_bits.state_estimate)."""
    return "≈" if r.get("disk", {}).get("estimated") else ""


def rows_of(res: dict, protocol: str) -> list[dict]:
    return sorted((r for r in res["rows"] if r["protocol"] == protocol), key=lambda r: (r["family"], r["bits"]))


def table(res: dict, protocol: str) -> list[str]:
    tuning = [t["name"] for t in res["texts"] if not t["held_aside"]]
    held = [t["name"] for t in res["texts"] if t["held_aside"]]
    head = ("| method | bits in memory | bits on disk: auto / best | tok KL (pooled) | Δppl [95% CI] | top-1 = fp32 | K / V err | "
            + " | ".join(f"KL {n}" for n in tuning) + "".join(f" | KL {n} | Δppl {n}" for n in held) + " |")
    out = [head, "|" + "---|" * (7 + len(tuning) + 2 * len(held))]
    for r in rows_of(res, protocol):
        p = r.get("pooled")
        cells = [r["name"], f"{r['bits']:.2f}", _disk_cell(r)]
        cells += [_e(p["tok_kl"]), _pct(p), f"{100 * p['top1_agree']:.1f}%", f"{_e(p['k_err'])} / {_e(p['v_err'])}"] \
            if p else ["–"] * 4
        cells += [_e(r["texts"][n]["tok_kl"]) for n in tuning]
        for n in held:
            cells += [_e(r["texts"][n]["tok_kl"]), _pct(r["texts"][n])]
        out.append("| " + " | ".join(cells) + " |")
    return out


# The goals: (preset, budget in bits/coord ON DISK, token KL at most, Δppl at most or None).
GOALS = (("small", 3.0, 0.10, None), ("balanced", 4.5, 0.03, 0.02), ("near-lossless", 6.0, 0.003, None))


def _bits_name(b) -> str:
    return f"{b[0]}+{b[1]}" if b[1] else f"{b[0]}"


def preset_rows(name: str) -> list[tuple[str, str, str]]:
    """(label, evaluated row name, compress mode its budget is measured with) of preset ``name``
    (rvqstore.presets): without a profile (per side) and with the SmolLM2 profile (per layer and side),
    in its grid form and its Lloyd–Max form (``grid=False``) where it has both."""
    from rvqstore.presets import get

    p = get(name)
    out = []
    for grid in ((True, False) if p.key_step is not None else (False,)):
        (kb, ks), (vb, vs) = p.sides(grid)
        if ks is None:
            k, v = _bits_name(kb), _bits_name(vb)
            side = (k if k == v else f"K {k} / V {v}")
        else:
            side = f"grid K s{ks:g} / V s{vs:g}"
        alloc = f"grid alloc {p.step_scale:g}" if grid and p.step_scale is not None else f"RVQ alloc {p.alloc_target:g}"
        tag = "" if grid or p.key_step is None else ", Lloyd–Max: grid=False"
        named = []
        for label, name, profile in (("per side", side, None), ("per layer+side, profile", alloc, "profile")):
            st = p.state(profile, grid)  # a method with codec state is named as quality.methods.variant names it
            tags = (["+mean K"] if st.get("center_keys") else []) + \
                ([f"+sink {st['sink_tokens']}"] if st.get("sink_tokens") else [])
            state = ", sink token exact + key mean" if tags else ""
            named.append((f"{label}{tag}{state}", f"{name} {' '.join(tags)}" if tags else name, p.compress(profile, grid)))
        out += named
    return out


def _rivals(rows: dict, r: dict, mode: str) -> list[dict]:
    """Rotated-affine rows at equal or fewer bits on disk, like for like (``mode`` of ours against
    the affine arrays' matching mode, disk_bits.LIKE), pooled over the tuning texts."""
    mine = on_disk(r, mode)
    return [x for x in rows.values() if x["family"].startswith("rotated") and on_disk(x, mode) is not None
            and on_disk(x, mode) <= mine + 1e-9]


def goals_table(res: dict, protocol: str = "half") -> list[str]:
    """Each preset against its goal (on-disk bits in the preset's compress mode: the largest over the
    tuning texts), pooled and on the held-aside text, and against every rotated-affine row of equal or
    fewer bits on disk (like for like), on every text."""
    rows = {r["name"]: r for r in rows_of(res, protocol)}
    held = [t["name"] for t in res["texts"] if t["held_aside"]]
    names = [t["name"] for t in res["texts"]]
    out = ["| preset | as evaluated | bits in memory | bits on disk: max over tuning texts (budget), mode | auto | "
           "tok KL pooled (goal) | Δppl pooled | " + "".join(f"bits on disk {h} | tok KL {h} | Δppl {h} | " for h in held)
           + "goal | ahead of rotated affine at ≤ bits on disk (like for like), every text |",
           "|" + "---|" * (9 + 3 * len(held))]
    for preset, budget, kl_goal, ppl_goal in GOALS:
        for label, name, mode in preset_rows(preset):
            r = rows.get(name)
            if r is None or "pooled" not in r or on_disk(r, mode) is None:
                continue
            p = r["pooled"]
            disk_max = on_disk(r, mode, stat="max")
            ok = disk_max <= budget + 1e-9 and p["tok_kl"] <= kl_goal and (ppl_goal is None or p["ppl_delta"] <= ppl_goal)
            rivals = _rivals(rows, r, mode)
            beaten = [x for x in rivals if all(r["texts"][n]["tok_kl"] < x["texts"][n]["tok_kl"] for n in names)]
            goal = f"≤ {kl_goal:g}" + (f", Δppl ≤ +{100 * ppl_goal:g}%" if ppl_goal else "")
            auto = on_disk(r, "auto", stat="max")
            cells = [f"{preset} ({label})", f"`{name}`", f"{r['bits']:.2f}", f"{_est(r)}{disk_max:.3f} (≤ {budget:g}), {mode}",
                     f"{auto:.3f}" if auto is not None else "–", f"{_e(p['tok_kl'])} ({goal})", _pct(p)]
            for h in held:
                hd = on_disk(r, mode, text=h)
                cells += [f"{hd:.3f}" if hd is not None else "–", _e(r["texts"][h]["tok_kl"]), _pct(r["texts"][h])]
            cells += ["**met**" if ok else "missed",
                      (f"yes ({len(beaten)} of {len(rivals)}; lowest-KL rival {min(rivals, key=lambda x: x['pooled']['tok_kl'])['name']})"
                       if len(beaten) == len(rivals) else
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


def plot(res: dict, path: Path, protocol: str = "half", mode: str = "auto") -> None:
    """Bits on disk (``mode`` of ours, like for like for the affine rows; rows without it: auto) against
    token KL, pooled and per text."""
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
            def x(r, t):
                v = on_disk(r, mode, text=t)
                return on_disk(r, text=t) if v is None else v

            pts = sorted((x(r, None if n == "pooled" else n), (r["pooled"] if n == "pooled" else r["texts"][n])["tok_kl"])
                         for r in rows if r["family"] == f and on_disk(r) is not None and r["bits"] <= 10)
            if pts:
                marker = "o-" if len(pts) > 1 else "*"
                ax.plot([p[0] for p in pts], [max(p[1], 1e-6) for p in pts], marker, color=cmap(i % 10), label=f,
                        ms=5 if len(pts) > 1 else 12)
        ax.set_yscale("log")
        ax.set_xlabel(f"bits per coordinate on disk ({mode}, like for like)")
        ax.set_title(n + (" (tuning texts)" if n == "pooled" else ""))
        ax.grid(alpha=0.3, which="both")
        for y in (0.003, 0.03, 0.10):
            ax.axhline(y, color="grey", lw=0.6, ls=":")
    axes[0].set_ylabel("mean token KL vs float32 cache")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_BITS_NOTE = ("Bits on disk: the cached half of each text (the first half of its tokens) saved with "
              "`save_prompt_cache` as a real `.rvq` file (token ids and model fingerprint included, as "
              "`rvqstore cache-prompt` writes it), file bytes x 8 / (tokens x layers x kv heads x head dim x 2): "
              "everything counted; `compress=\"auto\"` (zstd, the default) or `best` (raw/zstd/rANS, the smallest per "
              "section: what uniform-grid presets are saved with). Affine baselines: mlx-lm's packed uint32 codes + "
              "float16 scales + biases, each array zstd-compressed with the writer's level and keep-if-it-saves-2% "
              "rule (like for like with `auto`), and for `best` their codes also sized under our rANS coder with a "
              "table per head-dim column, the smaller kept (like for like with `best`); no container header counted "
              "for them. Bits in memory: the fixed width (codes, norms, packing; a uniform grid's levels are wider "
              "in memory than on disk).")


def _scope(res: dict) -> str:
    return f"{res['n_tokens']} tokens per text, {res['n_tokens'] // 2} cached and {res['n_tokens'] // 2} scored"


def render(res: dict, precise: dict | None = None) -> str:
    """The page; ``precise``: the preset rows and closest baselines on more tokens, for the goals table."""
    goals_src = precise or res
    out = ["# Quality per bit on disk: token KL against the unquantized cache, on texts of several kinds", "",
           f"Generated by `tools/eval_quality.py` (model: {res['model']}; float32 on CPU; the full sweep on "
           f"{_scope(res)}" + (f", the presets and their closest baselines on {_scope(precise)}" if precise else "")
           + "). The plot is `docs/quality.png`: bits per coordinate on disk against the mean token KL of each "
           "method, pooled over the tuning texts and per text; dotted lines at the goals' 0.003 / 0.03 / 0.10"
           + (f" ({_scope(precise)}; files with `best`, like for like)" if precise else "") + ".", "",
           "![bits on disk vs token KL](quality.png)", ""]
    if FINDINGS.exists():
        out += [FINDINGS.read_text(encoding="utf-8").rstrip(), ""]
    out += ["## Goals of issue 11", "", f"On {_scope(goals_src)}. Pooled over the tuning texts; the held-aside "
            "text separately. A budget is met when the file of every tuning text is within it.", "", _BITS_NOTE, ""]
    out += goals_table(goals_src) + [""]
    if precise:
        out += [f"### The preset rows and closest baselines on {_scope(precise)}", ""] + table(precise, "half") + [""]
    out += ["## Texts", ""] + texts_table(res) + [""]
    for proto in res["protocols"]:
        desc = ("first half prefilled in chunks of 512, second half in one pass" if proto == "half" else
                f"the whole text in chunks of {res['chunk']} tokens, the second half scored")
        out += [f"## All methods on {_scope(res)}, protocol `{proto}` ({desc})", "",
                "tok KL = mean over scored tokens of KL(p_float32 ‖ p_method) of the next-token distribution; "
                "pooled = mean of the per-text means over the tuning texts. Δppl pools their tokens; its 95% "
                "interval is a paired moving-block bootstrap (blocks of 32 tokens, resampled within each text). "
                "K / V err = E‖x−x̂‖²/‖x‖² over every cached vector. Bits on disk pooled over the tuning texts "
                "(methods without a file form: –).", ""] + table(res, proto) + [""]
    recipe = res.get("recipe") or [f"python tools/eval_quality.py {a}" for a in res.get("argv", "").split("\n")]
    out += ["## How to reproduce", "", "```",
            "python tools/probe_sensitivity.py --tokens 512 --text prose=tools/texts/prose-genesis-joseph.txt "
            "--out tools/results/quality-sensitivity-smollm2.json", *recipe, "```", ""]
    return "\n".join(out)


def write_report(res: dict, folder: Path, precise: dict | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # the plot shows the runs the goals are judged on when there are (the presets, the grids, the rivals)
    plot(precise or res, folder / "quality.png", "half" if precise else res["protocols"][0], "best" if precise else "auto")
    (folder / "quality.md").write_text(render(res, precise), encoding="utf-8")
