"""Resume a cached prompt from ``.rvq`` vs re-running the prefill vs mlx-lm's own prompt-cache files.

On the bundled SmolLM2-135M-Instruct (dense float32 on CPU, OpenBLAS), for prompts of real text
(``rvqstore/data/python_docs_excerpt.txt``) of 512 ... 4096 tokens, in one run:

1. file size: ``.rvq`` (2+2 bits, what ``rvqstore.cache_prompt`` writes) vs mlx-lm's
   ``save_prompt_cache`` of a ``KVCache`` cast to float16 (mlx-lm writes the whole pre-allocated
   buffer; the bytes reported are what it really writes) and of a 4-bit affine ``QuantizedKVCache``
   (group 64, quantized from the float16 cache: float16 scales/biases, as for a float16 model).
2. time to first token for "cached prompt + 1 new token": ``rvqstore.resume`` + one forward (packed
   and resident modes, with the model-fingerprint check as documented and, to isolate its cost,
   without), re-running the whole prefill (into an RVQ cache and into an mlx-lm ``KVCache``), and
   mlx-lm ``load_prompt_cache`` + one forward for the float16 and 4-bit files. "warm": the files sit
   in the page cache (all of them were just written; same for every arm). "cold": the file is
   fsync'ed and evicted from this machine's page cache (``posix_fadvise(DONTNEED)``) right before the
   arm runs (the virtual disk's host may still cache it).
3. greedy decoding tokens/s at 1k and 4k tokens of context: RVQKVCache ``packed`` and ``resident``
   (loaded from the ``.rvq`` file) vs mlx-lm ``KVCache`` (float32, this model's dtype) and 4-bit
   ``QuantizedKVCache`` (group 64), with ``sum(cache.nbytes)`` while generating.

Method (tools/bench_codec.py, the seed post): every arm is warmed up first; the arms run interleaved
round by round, in an order rotated each round; inputs rotate (each round appends a different next
token to the cached prompt, re-prefills use a different slice of the text, generation starts from a
different token); medians and ratios come from the same run. Prefilling is the expensive arm: the
first prefill of each length (which also makes the files) is its round 0, and it gets fewer rounds.

    python tools/bench_resume.py [--quick] [--json tools/results/resume-cpu.json] [--md tools/results/resume-cpu.md]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rvqstore.blas import blas_is_fast, maybe_reexec_with_openblas  # noqa: E402

maybe_reexec_with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.models import cache as lm  # noqa: E402

import rvqstore  # noqa: E402
from rvqstore.generation import prefill  # noqa: E402
from rvqstore.model import load_model, model_fingerprint  # noqa: E402

TEXT = ROOT / "rvqstore" / "data" / "python_docs_excerpt.txt"
SLICE_STRIDE = 1499  # token offset between the text slices that rotating arms use

GOALS = {
    "file_ratio_fp16": 3.8,  # .rvq at least this many times smaller than mlx-lm's fp16 file
    "resume_vs_prefill_4096": 20.0,  # resume at least this many times faster than re-prefill at 4096
    "resume_vs_fp16_load": 1.0,  # resume no slower than mlx-lm fp16 load + forward
    "packed_gen_slowdown_4k": 2.0,  # KVCache tok/s / packed tok/s at most this at 4k context
    "resident_gen_slowdown_4k": 1.2,
}


def median(xs):
    return statistics.median(xs) if xs else None


def evict(path: str) -> None:
    """Drop ``path`` from this machine's page cache (after writing back any dirty pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def first_token(logits: mx.array) -> int:
    return int(mx.argmax(logits[:, -1, :] if logits.ndim == 3 else logits, axis=-1).item())


class Bench:
    def __init__(self, args):
        self.args = args
        b1, _, b2 = args.bits.partition("+")
        self.bits = (int(b1), int(b2 or 0))
        self.model, self.tok = load_model()
        self.ids = self.tok.encode(TEXT.read_text(encoding="utf-8"))
        self.n_layers = len(self.model.layers)
        self.work = Path(tempfile.mkdtemp(prefix="bench_resume_", dir=args.workdir))

    # ---- pieces ----------------------------------------------------------------------------------
    def slice(self, L: int, r: int) -> tuple[list[int], int]:
        """Prompt slice r of length L and the token that follows it in the text."""
        span = len(self.ids) - L - 1
        o = (r * SLICE_STRIDE) % max(1, span)
        return self.ids[o:o + L], self.ids[o + L]

    def forward1(self, cache, token: int) -> int:
        return first_token(self.model(mx.array([[token]], dtype=mx.int32), cache=cache))

    def kv_cache(self):
        return [lm.KVCache() for _ in range(self.n_layers)]

    @staticmethod
    def to_fp16(kv):
        out = []
        for c in kv:  # the whole buffer, as mlx-lm's save_prompt_cache stores it
            n = lm.KVCache()
            n.state = (c.keys.astype(mx.float16), c.values.astype(mx.float16), c.offset)
            out.append(n)
        mx.eval([c.keys for c in out], [c.values for c in out])
        return out

    @staticmethod
    def to_q4(kv):
        out = [c.to_quantized(group_size=64, bits=4) for c in kv]
        mx.eval([c.state[:2] for c in out])
        return out

    # ---- TTFT arms: each returns the first token; the caller times it ----------------------------------
    def arm_resume(self, files, prompt, *, mode, check=True, cold=False):
        if cold:
            evict(files["rvq"])
        r = rvqstore.resume(files["rvq"], prompt, self.model if check else None,
                            tokenizer=self.tok if check else None, mode=mode)
        assert r.reused == len(prompt) - 1 and len(r.remaining) == 1, (r.reused, len(r.remaining))
        return self.forward1(r.cache, r.remaining[0])

    def arm_mlx_load(self, files, prompt, *, kind, cold=False):
        if cold:
            evict(files[kind])
        cache = lm.load_prompt_cache(files[kind])
        return self.forward1(cache, prompt[-1])

    def arm_reprefill(self, prompt, *, kind):
        cache = rvqstore.make_prompt_cache(self.model, self.bits) if kind == "rvq" else self.kv_cache()
        return first_token(prefill(self.model, prompt, cache))

    def ttft_arms(self, files):
        return {
            "rvq-packed": lambda p: self.arm_resume(files, p, mode="packed"),
            "rvq-resident": lambda p: self.arm_resume(files, p, mode="resident"),
            "rvq-packed-nocheck": lambda p: self.arm_resume(files, p, mode="packed", check=False),
            "mlx-fp16": lambda p: self.arm_mlx_load(files, p, kind="fp16"),
            "mlx-q4": lambda p: self.arm_mlx_load(files, p, kind="q4"),
            "rvq-packed-cold": lambda p: self.arm_resume(files, p, mode="packed", cold=True),
            "mlx-fp16-cold": lambda p: self.arm_mlx_load(files, p, kind="fp16", cold=True),
            "mlx-q4-cold": lambda p: self.arm_mlx_load(files, p, kind="q4", cold=True),
        }

    # ---- one prompt length -------------------------------------------------------------------------
    def make_files(self, L: int, tag: str = ""):
        """Round 0 of both re-prefill arms: prefill slice 0 into an RVQ cache (saved as .rvq) and into
        a KVCache (saved by mlx-lm as fp16 and 4-bit), then the one-token forward for the first token.
        Returns (files, sizes, {arm: seconds}, float32 KVCache at L tokens)."""
        prompt, nxt = self.slice(L, 0)
        files = {k: str(self.work / f"p{L}{tag}.{ext}") for k, ext in
                 (("rvq", "rvq"), ("fp16", "fp16.safetensors"), ("q4", "q4.safetensors"))}
        times = {}
        # RVQ: prefill (timed), save (timed apart), forward the next token (timed)
        cache = rvqstore.make_prompt_cache(self.model, self.bits)
        t0 = time.perf_counter()
        prefill(self.model, prompt, cache)
        t_pre = time.perf_counter() - t0
        t0 = time.perf_counter()
        rvq_bytes = rvqstore.save_prompt_cache(files["rvq"], cache, tokens=prompt, model=self.model, tokenizer=self.tok)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.forward1(cache, nxt)
        times["reprefill-rvq"] = t_pre + time.perf_counter() - t0
        rvq_packed_used = sum(c.packed_nbytes for c in cache)
        del cache
        # KVCache
        kv = self.kv_cache()
        t0 = time.perf_counter()
        prefill(self.model, prompt, kv)
        t_pre = time.perf_counter() - t0
        kv16 = self.to_fp16(kv)
        q4 = self.to_q4(kv16)
        t0 = time.perf_counter()
        lm.save_prompt_cache(files["fp16"], kv16)
        t_save_fp16 = time.perf_counter() - t0
        lm.save_prompt_cache(files["q4"], q4)
        cap = kv16[0].keys.shape[2]
        del kv16, q4
        t0 = time.perf_counter()
        self.forward1(kv, nxt)
        times["reprefill-kv"] = t_pre + time.perf_counter() - t0
        for c in kv:
            c.trim(1)  # back to the L prompt tokens (generation arms reuse it)
        sizes = {
            "tokens": L,
            "rvq_bytes": rvq_bytes,
            "rvq_payload_bytes": rvq_packed_used,
            "fp16_bytes": os.path.getsize(files["fp16"]),
            "fp16_buffer_tokens": cap,
            "fp16_used_kv_bytes": L * self.n_layers * 2 * kv[0].keys.shape[1] * kv[0].keys.shape[3] * 2,
            "q4_bytes": os.path.getsize(files["q4"]),
            "rvq_save_s": t_save,
            "fp16_save_s": t_save_fp16,
        }
        sizes["fp16_over_rvq"] = sizes["fp16_bytes"] / rvq_bytes
        sizes["q4_over_rvq"] = sizes["q4_bytes"] / rvq_bytes
        sizes["rvq_bits_per_kv_coord"] = 8 * rvq_bytes / (sizes["fp16_used_kv_bytes"] / 2)
        return files, sizes, times, kv

    def run_length(self, L: int, rounds: int, prefill_rounds: int):
        print(f"\n== {L} tokens: making files (prefill round 0) ...", flush=True)
        files, sizes, t0s, kv = self.make_files(L)
        print(f"   .rvq {sizes['rvq_bytes']:,} B | mlx fp16 {sizes['fp16_bytes']:,} B ({sizes['fp16_over_rvq']:.2f}x) | "
              f"mlx 4-bit {sizes['q4_bytes']:,} B ({sizes['q4_over_rvq']:.2f}x)", flush=True)
        print(f"   round 0 prefill: rvq {t0s['reprefill-rvq']:.2f}s, kv {t0s['reprefill-kv']:.2f}s", flush=True)
        arms = self.ttft_arms(files)
        samples = {k: [] for k in arms}
        samples["reprefill-rvq"] = [t0s["reprefill-rvq"]]
        samples["reprefill-kv"] = [t0s["reprefill-kv"]]
        base, _ = self.slice(L, 0)
        # warm-up at this length (allocator sizes, page cache for the warm arms)
        for name, f in arms.items():
            f(base + [self.ids[L]])
        names = list(arms)
        for r in range(rounds):
            nxt = self.ids[(L + 1 + r * 7) % len(self.ids)]  # a different new token each round
            prompt = base + [nxt]
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                t = time.perf_counter()
                arms[name](prompt)
                samples[name].append(time.perf_counter() - t)
            ran = list(order)
            if r == 0 or r < prefill_rounds:  # round 0 of the re-prefill arms was make_files
                ran += ["reprefill-rvq", "reprefill-kv"]
            if 1 <= r < prefill_rounds:
                p, n = self.slice(L, r)
                for kind in (("rvq", "kv") if r % 2 else ("kv", "rvq")):
                    t = time.perf_counter()
                    self.arm_reprefill(p + [n], kind=kind)
                    samples[f"reprefill-{kind}"].append(time.perf_counter() - t)
            print(f"   round {r}: " + ", ".join(f"{k} {samples[k][-1]:.3f}" for k in samples if k in ran), flush=True)
        for r in range(rounds, prefill_rounds):  # more prefill rounds than cheap rounds (only if asked)
            p, n = self.slice(L, r)
            for kind in ("rvq", "kv"):
                t = time.perf_counter()
                self.arm_reprefill(p + [n], kind=kind)
                samples[f"reprefill-{kind}"].append(time.perf_counter() - t)
        med = {k: median(v) for k, v in samples.items()}
        fastest_prefill = min(med["reprefill-rvq"], med["reprefill-kv"])
        ratios = {
            "reprefill_over_resume": {k: fastest_prefill / med[k] for k in arms if k.startswith("rvq")},
            "reprefill_rvq_over_resume_packed": med["reprefill-rvq"] / med["rvq-packed"],
            "reprefill_kv_over_resume_packed": med["reprefill-kv"] / med["rvq-packed"],
            "fp16_load_over_resume": {k: med["mlx-fp16"] / med[k] for k in arms if k.startswith("rvq") and "cold" not in k},
            "fp16_load_over_resume_cold": med["mlx-fp16-cold"] / med["rvq-packed-cold"],
            "q4_load_over_resume": med["mlx-q4"] / med["rvq-packed"],
        }
        return files, kv, {"tokens": L, "sizes": sizes, "ttft_s": samples, "ttft_median_s": med, "ratios": ratios,
                           "rounds": rounds, "prefill_rounds": max(1, prefill_rounds)}

    # ---- generation ----------------------------------------------------------------------------------
    def gen(self, cache, start: int, n: int) -> tuple[float, int]:
        y = start
        t0 = time.perf_counter()
        for _ in range(n):
            y = self.forward1(cache, y)
        dt = time.perf_counter() - t0
        nbytes = sum(c.nbytes for c in cache)
        for c in cache:
            c.trim(n)  # back to the prompt, for the next round
        return dt, nbytes

    def run_generation(self, C: int, files, kv, rounds: int, n_tokens: int):
        print(f"\n== generation at {C} tokens of context, {n_tokens} greedy tokens per round", flush=True)
        caches = {
            "rvq-packed": rvqstore.load_prompt_cache(files["rvq"], model=self.model, tokenizer=self.tok, mode="packed"),
            "rvq-resident": rvqstore.load_prompt_cache(files["rvq"], model=self.model, tokenizer=self.tok,
                                                       mode="resident"),
            "mlx-kv": kv,
            "mlx-q4": self.to_q4(kv),
        }
        assert all(c[0].offset == C for c in caches.values())
        held_at_prompt = {k: sum(c.nbytes for c in v) for k, v in caches.items()}
        for name, c in caches.items():  # warm-up (also grows every buffer past the prompt once)
            self.gen(c, self.ids[C], min(4, n_tokens))
        tps = {k: [] for k in caches}
        held = {}
        names = list(caches)
        for r in range(rounds):
            start = self.ids[(C + 3 + r * 11) % len(self.ids)]
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                dt, nb = self.gen(caches[name], start, n_tokens)
                tps[name].append(n_tokens / dt)
                held[name] = nb
            print(f"   round {r}: " + ", ".join(f"{k} {v[-1]:.2f} tok/s" for k, v in tps.items()), flush=True)
        med = {k: median(v) for k, v in tps.items()}
        return {"context": C, "new_tokens": n_tokens, "rounds": rounds, "tokens_per_s": tps,
                "tokens_per_s_median": med, "nbytes_while_generating": held, "nbytes_at_prompt": held_at_prompt,
                "kv_over": {k: med["mlx-kv"] / med[k] for k in caches}}

    def warmup(self):
        """Every arm once on a short prompt (compiles, allocator, imports)."""
        L = 64
        files, _, _, kv = self.make_files(L, tag="-warmup")
        p, _ = self.slice(L, 0)
        for f in self.ttft_arms(files).values():
            f(p + [self.ids[L]])
        for kind in ("rvq", "kv"):
            self.arm_reprefill(p + [self.ids[L]], kind=kind)
        self.run_generation(L, files, kv, 1, 2)


def goals(res: dict) -> list[dict]:
    out = []
    lengths = res["lengths"]
    ratios = [x["sizes"]["fp16_over_rvq"] for x in lengths]
    out.append({"goal": f"files >= {GOALS['file_ratio_fp16']}x smaller than mlx-lm fp16 files",
                "measured": ", ".join(f"{x['tokens']}: {x['sizes']['fp16_over_rvq']:.2f}x" for x in lengths),
                "pass": all(r >= GOALS["file_ratio_fp16"] for r in ratios)})
    at = [x for x in lengths if x["tokens"] == 4096]
    if at:
        r = at[0]["ratios"]["reprefill_over_resume"]
        out.append({"goal": f"resume >= {GOALS['resume_vs_prefill_4096']}x faster than re-prefill at 4096 "
                            "(faster re-prefill arm vs rvq-packed resume, model check included)",
                    "measured": f"{r['rvq-packed']:.1f}x (resident {r['rvq-resident']:.1f}x, "
                                f"no check {r['rvq-packed-nocheck']:.1f}x)",
                    "pass": r["rvq-packed"] >= GOALS["resume_vs_prefill_4096"]})
    else:
        out.append({"goal": "resume >= 20x faster than re-prefill at 4096", "measured": "not measured", "pass": None})
    m = [(x["tokens"], x["ratios"]["fp16_load_over_resume"]["rvq-packed"],
          x["ratios"]["fp16_load_over_resume"]["rvq-packed-nocheck"], x["ratios"]["fp16_load_over_resume_cold"])
         for x in lengths]
    out.append({"goal": "resume no slower than mlx-lm fp16 load + forward (ratio fp16 TTFT / rvq-packed TTFT >= 1)",
                "measured": "; ".join(f"{t}: {a:.2f}x (no check {b:.2f}x, cold {c:.2f}x)" for t, a, b, c in m),
                "pass": all(a >= GOALS["resume_vs_fp16_load"] for _, a, _, _ in m)})
    g4 = [g for g in res["generation"] if g["context"] == 4096]
    for mode, key in (("packed", "packed_gen_slowdown_4k"), ("resident", "resident_gen_slowdown_4k")):
        if g4:
            s = g4[0]["kv_over"][f"rvq-{mode}"]
            out.append({"goal": f"generation, {mode} mode within {GOALS[key]}x of mlx-lm KVCache tok/s at 4k context",
                        "measured": f"KVCache is {s:.2f}x faster", "pass": s <= GOALS[key]})
        else:
            out.append({"goal": f"generation, {mode} mode at 4k context", "measured": "not measured", "pass": None})
    return out


def mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def markdown(res: dict) -> str:
    m = res["meta"]
    L = []
    L.append("# Resume benchmark (CPU): `.rvq` vs re-prefill vs mlx-lm prompt-cache files\n")
    L.append(f"`{m['command']}` — {m['date']}, {m['runtime_s']:.0f} s wall; mlx {m['mlx']} ({m['device']}), "
             f"mlx-lm {m['mlx_lm']}, OpenBLAS {m['fast_blas']}, {m['cpus']} CPUs shared with other jobs "
             f"(load average {m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end); "
             f"commit {m['commit']}"
             + (f" (+ uncommitted changes in {', '.join(m['modified_files'])})" if m["modified_files"] else "")
             + ". Model: bundled SmolLM2-135M-Instruct, dense float32, "
             f"{m['n_layers']} layers x {m['n_kv_heads']} KV heads x head dim {m['head_dim']}. "
             "Real text: rvqstore/data/python_docs_excerpt.txt. Medians; all ratios from this one run.\n")
    L.append("## File size\n")
    L.append("| tokens | .rvq (2+2) | mlx-lm fp16 | fp16 / rvq | mlx-lm 4-bit (g64) | 4-bit / rvq | rvq bits per K/V coord |")
    L.append("|---:|---:|---:|---:|---:|---:|---:|")
    for x in res["lengths"]:
        s = x["sizes"]
        L.append(f"| {s['tokens']} | {s['rvq_bytes']:,} | {s['fp16_bytes']:,} | {s['fp16_over_rvq']:.2f}x | "
                 f"{s['q4_bytes']:,} | {s['q4_over_rvq']:.2f}x | {s['rvq_bits_per_kv_coord']:.2f} |")
    L.append("\nmlx-lm writes its whole KVCache buffer (capacity: "
             + ", ".join(f"{x['tokens']}: {x['sizes']['fp16_buffer_tokens']}" for x in res["lengths"])
             + " tokens; chunked prefill of 512 fills it exactly at these lengths), plus a small safetensors header.\n")
    L.append("## Time to first token: cached prompt + 1 new token (seconds, median)\n")
    arms = ["rvq-packed", "rvq-resident", "rvq-packed-nocheck", "mlx-fp16", "mlx-q4", "rvq-packed-cold",
            "mlx-fp16-cold", "mlx-q4-cold", "reprefill-rvq", "reprefill-kv"]
    L.append("| tokens | " + " | ".join(arms) + " | re-prefill / resume | fp16 / resume |")
    L.append("|---:|" + "---:|" * (len(arms) + 2))
    for x in res["lengths"]:
        med, r = x["ttft_median_s"], x["ratios"]
        L.append(f"| {x['tokens']} | " + " | ".join(f"{med[a]:.3f}" for a in arms)
                 + f" | {r['reprefill_over_resume']['rvq-packed']:.1f}x | {r['fp16_load_over_resume']['rvq-packed']:.2f}x |")
    L.append("\nRounds per length: "
             + ", ".join(f"{x['tokens']}: {x['rounds']} (re-prefill {x['prefill_rounds']})" for x in res["lengths"])
             + ". Arms: `rvq-*` = `rvqstore.resume(path, prompt + [next], model, tokenizer=...)` (mode packed or "
             "resident; fingerprint check included) then one forward; `-nocheck` = same without the model "
             "(no fingerprint check). The fingerprint is memoized per model (rvqstore.prompt_cache), so the check "
             f"costs ~0 here; the first save/load/resume with a model in a fresh process pays it once: "
             f"{res['meta']['fingerprint_s']:.2f} s (median of 3) on top of these numbers. "
             "`mlx-*` = `mlx_lm.models.cache.load_prompt_cache(file)` then one forward; `reprefill-*` = "
             "the whole prompt + 1 through the model into a fresh RVQ cache / mlx-lm KVCache (round 0 is the run that "
             "made the files). Each includes the argmax of the first token. `-cold`: the file was evicted from the "
             "page cache (fsync + posix_fadvise DONTNEED) just before; other arms: files in page cache, equally for "
             "all. re-prefill / resume uses the faster re-prefill arm and rvq-packed.\n")
    L.append("## Generation (greedy, tokens/s, median) and bytes held\n")
    L.append("| context | new tokens | rvq-packed | rvq-resident | mlx-lm KVCache f32 | mlx-lm 4-bit | KVCache / packed | "
             "KVCache / resident | bytes held: packed / resident / KVCache / 4-bit |")
    L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for g in res["generation"]:
        t, h, k = g["tokens_per_s_median"], g["nbytes_while_generating"], g["kv_over"]
        L.append(f"| {g['context']} | {g['new_tokens']} | {t['rvq-packed']:.2f} | {t['rvq-resident']:.2f} | "
                 f"{t['mlx-kv']:.2f} | {t['mlx-q4']:.2f} | {k['rvq-packed']:.2f}x | {k['rvq-resident']:.2f}x | "
                 f"{mib(h['rvq-packed'])} / {mib(h['rvq-resident'])} / {mib(h['mlx-kv'])} / {mib(h['mlx-q4'])} |")
    L.append("\nBytes held = `sum(cache.nbytes)` over layers at the end of a round (allocated capacity, "
             f"{res['generation'][0]['rounds'] if res['generation'] else 0} rounds interleaved per context).\n")
    L.append("## Goals\n")
    L.append("| goal | measured | result |")
    L.append("|---|---|---|")
    for g in res["goals"]:
        L.append(f"| {g['goal']} | {g['measured']} | {'n/a' if g['pass'] is None else ('PASS' if g['pass'] else 'FAIL')} |")
    return "\n".join(L) + "\n"


def parse_rounds(spec: str) -> dict[int, int]:
    return {int(k): int(v) for k, v in (p.split(":") for p in spec.split(","))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", default="2+2", help="RVQ bits per stage (default 2+2: the ~4-bit point the goals name)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the cheap TTFT arms per length")
    ap.add_argument("--prefill-rounds", type=str, default="512:3,1024:3,2048:2,4096:2",
                    help="re-prefill rounds per length (round 0 is the run that makes the files); default for "
                         "unlisted lengths: 2")
    ap.add_argument("--gen-contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--gen-rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke run: 512 tokens, 1 round, 8 generated tokens")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--workdir", type=str, default=None, help="where the cache files go (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.rounds, args.prefill_rounds = [512], 1, "512:1"
        args.gen_contexts, args.gen_tokens, args.gen_rounds = [512], 8, 1
    prefill_rounds = parse_rounds(args.prefill_rounds)
    lengths = sorted(set(args.lengths) | set(args.gen_contexts))
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    b = Bench(args)
    if max(lengths) + SLICE_STRIDE + 1 > len(b.ids):
        sys.exit(f"the text has {len(b.ids)} tokens; lengths up to {len(b.ids) - SLICE_STRIDE - 1} are supported")
    a0 = b.model.layers[0].self_attn
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.split()[1::2]
    except OSError:
        commit, dirty = "?", []
    fp_times = []
    for _ in range(3):  # what the first save/load/resume with a model costs in a fresh process
        t = time.perf_counter()
        model_fingerprint(b.model, b.tok)
        fp_times.append(time.perf_counter() - t)
    meta = {"device": str(mx.default_device()), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(), "fast_blas": blas_is_fast(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit, "modified_files": dirty,
            "fingerprint_s": median(fp_times), "text_tokens": len(b.ids),
            "n_layers": b.n_layers, "n_kv_heads": a0.n_kv_heads, "head_dim": b.model.args.head_dim,
            "command": "python tools/bench_resume.py " + " ".join(sys.argv[1:]), "loadavg_start": load0}
    print(f"# {meta}", flush=True)
    print("warm-up ...", flush=True)
    b.warmup()
    res = {"meta": meta, "lengths": [], "generation": []}
    kept = {}
    for L in lengths:
        files, kv, row = b.run_length(L, args.rounds, prefill_rounds.get(L, 2))
        if L in args.lengths:
            res["lengths"].append(row)
        if L in args.gen_contexts:
            kept[L] = (files, kv)
        else:
            del kv
    for C in args.gen_contexts:
        files, kv = kept.pop(C)
        res["generation"].append(b.run_generation(C, files, kv, args.gen_rounds, args.gen_tokens))
        del kv
    meta["runtime_s"] = time.perf_counter() - t_start
    meta["loadavg_end"] = os.getloadavg()
    res["goals"] = goals(res)
    md = markdown(res)
    print("\n" + md)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md)
    for p in b.work.iterdir():
        p.unlink()
    b.work.rmdir()


if __name__ == "__main__":
    main()
