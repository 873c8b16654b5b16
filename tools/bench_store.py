"""The prefix store on the bundled SmolLM2-135M-Instruct (CPU, float32, OpenBLAS), 4+2-bit blocks of 64 tokens.

1. Time to first token for a cached 4k-token prefix (prompt = 4096 cached tokens + 1 new token):
   ``PrefixStore.longest_prefix`` (a fresh store object each round, as a restarted process has; the
   model fingerprint is computed once per process and not counted) + one forward, from a local
   directory and from S3 (moto's server on loopback, obstore), vs re-running the prefill (mlx-lm
   ``KVCache``). Two different 4k slices of real text are cached and the rounds alternate between
   them; arms interleaved in a rotated order; warm-up round first; medians; same-run ratios.
2. Bytes stored for N prompts sharing a system prompt (2048 tokens) and each adding its own 200
   tokens of other text, vs one ``.rvq`` file per prompt, and vs the bytes of the unique tokens
   (2048 + N x 200 tokens at the bytes per token of one ``.rvq`` file of a whole prompt).
3. Bytes read by a partial-prefix hit (a prompt sharing the first 1000 tokens of a stored 4k prompt,
   not block-aligned) vs the whole stored entry, on S3 (bytes over the wire, counted) and locally.

    python tools/bench_store.py [--quick] [--md tools/results/store-cpu.md] [--json tools/results/store-cpu.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from rvqstore.blas import blas_is_fast, maybe_reexec_with_openblas  # noqa: E402

maybe_reexec_with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models import cache as lm  # noqa: E402

import rvqstore  # noqa: E402
from rvqstore.generation import prefill  # noqa: E402
from rvqstore.model import load_model  # noqa: E402
from rvqstore.prompt_cache import _fingerprint  # noqa: E402
from rvqstore.store import DEFAULT_BLOCK_SIZE, PrefixStore, scan  # noqa: E402
from rvqstore.store.keys import chain_keys  # noqa: E402

TEXT = ROOT / "rvqstore" / "data" / "python_docs_excerpt.txt"
OTHER = [ROOT / "tools" / "texts" / n for n in ("prose-genesis-joseph.txt", "code-cpython-textwrap.py",
                                                "heldaside-idle-news.txt")]


def first_token(logits) -> int:
    return int(mx.argmax(logits[:, -1, :] if logits.ndim == 3 else logits, axis=-1).item())


class Counting:
    """Wraps a backend; counts the bytes it fetches (whole objects and ranges)."""

    def __init__(self, inner):
        self.inner, self.bytes = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, path, max_bytes=None):
        data = self.inner.get(path, max_bytes=max_bytes)
        self.bytes += len(data or b"")
        return data

    def range_source(self, path):
        src = self.inner.range_source(path)
        if src is None:
            return None
        outer = self

        class Src:
            size, name = src.size, src.name

            def read(self, off, n):
                d = src.read(off, n)
                outer.bytes += len(d)
                return d

        return Src()


class Bench:
    def __init__(self, a):
        self.a = a
        self.model, self.tok = load_model()
        self.fp = _fingerprint(self.model, self.tok)  # once per process, like a server
        self.n_layers = len(self.model.layers)
        self.ids = self.tok.encode(TEXT.read_text(encoding="utf-8"))
        self.work = Path(tempfile.mkdtemp(prefix="bench_store_"))
        from store_helpers import start_moto

        self.moto, self.endpoint = start_moto()

    def store(self, where: str, **kw):
        if where == "local":
            return PrefixStore(str(self.work / "local"), fingerprint=self.fp, n_layers=self.n_layers,
                               block_size=self.a.block_size, **kw)
        return PrefixStore(self.s3_url, fingerprint=self.fp, n_layers=self.n_layers, endpoint=self.endpoint,
                           access_key_id="test", secret_access_key="test", block_size=self.a.block_size, **kw)

    def kv(self, toks):
        c = [lm.KVCache() for _ in range(self.n_layers)]
        logits = prefill(self.model, toks, c)
        return c, logits

    # ---- 1. time to first token -------------------------------------------------------------------------
    def ttft(self):
        L = self.a.length
        self.s3_url = f"s3://rvq-test/{uuid.uuid4().hex[:8]}"
        slices = [self.ids[o:o + L + 1] for o in (0, 1499)][: self.a.slices]
        put_s = {"local": [], "s3": []}
        for s in slices:
            cache, _ = self.kv(s[:L])
            for where in ("local", "s3"):
                t0 = time.perf_counter()
                r = self.store(where).put(s[:L], cache)
                put_s[where].append(time.perf_counter() - t0)
                assert r.new_tokens == L
        self.entry_paths = {w: self.store(w) for w in ("local", "s3")}

        def arm_store(where, prompt):
            st = self.store(where)
            n, caches = st.longest_prefix(prompt, max_tokens=len(prompt) - 1, mode="resident")
            assert n == len(prompt) - 1, n
            return first_token(self.model(mx.array([[prompt[n]]]), cache=caches))

        def arm_prefill(prompt):
            return first_token(self.kv(prompt)[1])

        arms = {"store-local": lambda p: arm_store("local", p), "store-s3": lambda p: arm_store("s3", p),
                "re-prefill": arm_prefill}
        times = {k: [] for k in arms}
        tokens = {}
        for r in range(self.a.rounds + 1):  # round 0: warm-up
            prompt = slices[r % len(slices)]
            names = list(arms)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                if name == "re-prefill" and r > self.a.prefill_rounds:
                    continue
                t0 = time.perf_counter()
                tok = arms[name](prompt)
                dt = time.perf_counter() - t0
                tokens.setdefault((r % len(slices)), set()).add(tok)
                if r > 0:
                    times[name].append(dt)
        med = {k: statistics.median(v) for k, v in times.items()}
        return {"length": L, "median_s": med, "samples_s": times, "put_s": put_s,
                "speedup_local": med["re-prefill"] / med["store-local"],
                "speedup_s3": med["re-prefill"] / med["store-s3"],
                "same_first_token": all(len(v) == 1 for v in tokens.values())}

    # ---- 2. bytes for N prompts sharing a system prompt -------------------------------------------------------
    def sharing(self):
        S, own, N, bsz = self.a.system, self.a.own, self.a.prompts, self.a.batch
        system = self.ids[:S]
        other = [t for p in OTHER for t in self.tok.encode(p.read_text(encoding="utf-8"))]
        sys_cache, _ = self.kv(system)
        mx.eval([c.keys for c in sys_cache])
        d = self.work / "shared"
        st = PrefixStore(str(d), fingerprint=self.fp, n_layers=self.n_layers, block_size=self.a.block_size)
        file_sizes = []
        t_put = 0.0
        owns = [[other[(i * own * 7 + j) % len(other)] for j in range(own)] for i in range(N)]
        for b0 in range(0, N, bsz):  # the prompts' own tokens run batched over the shared system cache
            group = owns[b0:b0 + bsz]
            batch = []
            for c in sys_cache:
                n = lm.KVCache()
                n.state = (mx.repeat(c.keys[:, :, :S], len(group), axis=0),
                           mx.repeat(c.values[:, :, :S], len(group), axis=0), S)
                batch.append(n)
            mx.eval(self.model(mx.array(group), cache=batch))
            for i, mine in enumerate(group):
                cache = []
                for c in batch:
                    n = lm.KVCache()
                    n.state = (c.keys[i:i + 1, :, :S + own], c.values[i:i + 1, :, :S + own], S + own)
                    cache.append(n)
                t0 = time.perf_counter()
                st.put(system + mine, cache)
                t_put += time.perf_counter() - t0
                if b0 + i < 1:  # one file per prompt: every prompt has the same length, one is measured
                    f = self.work / f"p{i}.rvq"
                    file_sizes.append(rvqstore.save_prompt_cache(f, cache, tokens=system + mine, model=self.model,
                                                                 tokenizer=self.tok))
            print(f"sharing: {b0 + len(group)} prompts stored", flush=True)
        idx = scan(st.backend)
        per_token = statistics.mean(file_sizes) / (S + own)
        unique_tokens = S + N * own
        return {"system_tokens": S, "own_tokens": own, "prompts": N, "block_size": self.a.block_size,
                "block_bytes": idx.block_bytes, "store_bytes": idx.total_bytes, "blocks": len(idx.blocks),
                "one_file_per_prompt_bytes": statistics.mean(file_sizes) * N, "file_bytes": file_sizes,
                "unique_tokens": unique_tokens, "unique_bytes": per_token * unique_tokens,
                "ratio_vs_unique": idx.total_bytes / (per_token * unique_tokens),
                "ratio_files_vs_store": statistics.mean(file_sizes) * N / idx.total_bytes,
                "put_s_mean": t_put / N}

    # ---- 3. bytes read by a partial-prefix hit ---------------------------------------------------------------
    def partial(self):
        L, share = self.a.length, self.a.share
        stored = self.ids[:L]
        query = stored[:share] + self.ids[L + 10: L + 110]
        out = {"shared_tokens": share, "stored_tokens": L}
        for where in ("local", "s3"):
            st = self.store(where)
            keys = {k for _, _, k in chain_keys(st.ns, stored, 0, st.block_size)}
            entry = sum(b.size for b in scan(st.backend, st.ns).blocks.values() if b.name.key in keys)
            if where == "s3":
                st.backend = Counting(st.backend)
            n, _ = st.longest_prefix(query)
            read = st.backend.bytes if where == "s3" else st.stats.bytes_read
            out[where] = {"hit_tokens": n, "bytes_read": read, "entry_bytes": entry, "fraction": read / entry,
                          "blocks_read": st.stats.blocks_read}
        return out

    def close(self):
        self.moto.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def markdown(res) -> str:
    lines = ["# Prefix store on SmolLM2-135M (CPU)", "",
             f"`tools/bench_store.py`; {res['machine']}; OpenBLAS: {res['fast_blas']}; 4+2 bits, "
             f"{res['args']['block_size']}-token blocks.", ""]
    if "ttft" in res:
        lines += markdown_ttft(res["ttft"])
    if "sharing" in res:
        lines += markdown_sharing(res["sharing"])
    if "partial" in res:
        lines += markdown_partial(res["partial"])
    return "\n".join(lines) + "\n"


def markdown_ttft(t) -> list[str]:
    m = t["median_s"]
    lines = [f"## Time to first token, cached {t['length']}-token prefix + 1 new token", "",
             "| arm | median s | samples |", "|---|---|---|"]
    for k in ("store-local", "store-s3", "re-prefill"):
        lines.append(f"| {k} | {m[k]:.3f} | {', '.join(f'{x:.3f}' for x in t['samples_s'][k])} |")
    return lines + ["", f"Speed-up vs re-prefill: local store **{t['speedup_local']:.1f}x**, loopback S3 "
                    f"**{t['speedup_s3']:.1f}x** (goal >= 20x). Same first token in every arm: {t['same_first_token']}. "
                    f"Put of a whole {t['length']}-token prompt: local {statistics.median(t['put_s']['local']):.2f} s, "
                    f"S3 {statistics.median(t['put_s']['s3']):.2f} s.", ""]


def markdown_sharing(s) -> list[str]:
    return [f"## {s['prompts']} prompts sharing a {s['system_tokens']}-token system prompt, {s['own_tokens']} own "
            f"tokens each", "",
            "| | bytes |", "|---|---|",
            f"| prefix store (blocks + namespace + use markers) | {s['store_bytes']:,} |",
            f"| unique tokens ({s['unique_tokens']:,} tokens at one .rvq file's bytes per token) | {s['unique_bytes']:,.0f} |",
            f"| one .rvq file per prompt | {s['one_file_per_prompt_bytes']:,.0f} |", "",
            f"Store / unique tokens = **{s['ratio_vs_unique']:.3f}** (goal <= 1.1); one file per prompt takes "
            f"{s['ratio_files_vs_store']:.1f}x the store's bytes. {s['blocks']} blocks; mean put "
            f"{s['put_s_mean']:.2f} s.", ""]


def markdown_partial(p) -> list[str]:
    lines = [f"## Partial-prefix hit: {p['shared_tokens']} of a stored {p['stored_tokens']}-token prompt", "",
             "| store | tokens reused | bytes read | whole entry | fraction |", "|---|---|---|---|---|"]
    for w in ("local", "s3"):
        q = p[w]
        lines.append(f"| {w} | {q['hit_tokens']} | {q['bytes_read']:,} | {q['entry_bytes']:,} | {q['fraction']:.3f} |")
    lines += ["", "S3: bytes over the wire, counted (whole blocks for the blocks the hit uses; the last, shared in "
              "part, is found by reading candidate blocks' token ids). Local: sizes of the block files opened "
              "(memory-mapped; an upper bound)."]
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the tool works")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--slices", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prefill-rounds", type=int, default=2)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--own", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--share", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=10, help="prompts whose own tokens run through the model together")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    ap.add_argument("--md", default="tools/results/store-cpu.md")
    ap.add_argument("--json", default="tools/results/store-cpu.json")
    ap.add_argument("--parts", default="ttft,partial,sharing", help="which measurements (comma-separated)")
    a = ap.parse_args()
    if a.quick:
        a.length, a.rounds, a.prefill_rounds, a.system, a.own, a.prompts, a.share = 512, 2, 1, 256, 40, 5, 200
    import logging
    import platform

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    b = Bench(a)
    try:
        res = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "fast_blas": blas_is_fast(),
               "args": vars(a)}
        parts = a.parts.split(",")
        if "ttft" in parts:
            res["ttft"] = b.ttft()
            print(json.dumps(res["ttft"], default=str), flush=True)
        if "partial" in parts:
            if "ttft" not in parts:
                raise SystemExit("--parts partial needs ttft (it reads the prompts ttft stores)")
            res["partial"] = b.partial()
            print(json.dumps(res["partial"]), flush=True)
        if "sharing" in parts:
            res["sharing"] = b.sharing()
            print(json.dumps(res["sharing"]), flush=True)
    finally:
        b.close()
    md = markdown(res)
    print(md)
    if not a.quick:
        Path(a.md).write_text(md)
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
