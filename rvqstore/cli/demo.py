"""The ``demo`` subcommand: end to end on the bundled model (cache, inspect, resume, continue)."""

from __future__ import annotations

import argparse
import time
from importlib import resources

from .file_commands import cmd_inspect
from .options import load_model
from .registry import subcommand


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="rvqstore-demo.rvq", help="where to write the snapshot")
    p.add_argument("--tokens", type=int, default=1024, help="prompt length taken from the bundled text")
    p.add_argument("--max-tokens", type=int, default=24)


@subcommand("demo", help="end to end on the bundled model: cache a prompt, inspect, resume, continue",
            configure=_demo_args)
def cmd_demo(args: argparse.Namespace) -> int:
    import os
    import tempfile

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache as lm_make_cache
    from mlx_lm.models.cache import save_prompt_cache as lm_save

    from .. import load_prompt_cache, resume
    from ..generation import cache_prompt, greedy_tokens, prefill

    args.model = None
    model, tokenizer = load_model(args)
    text = resources.files("rvqstore").joinpath("data/python_docs_excerpt.txt").read_text(encoding="utf-8")
    tokens = list(tokenizer.encode(text))[: args.tokens]
    print(f"model: bundled SmolLM2-135M-Instruct; prompt: {len(tokens)} tokens of the Python Language Reference")
    r = cache_prompt(model, tokenizer, tokens, args.out, metadata={"source": "rvqstore demo"})
    print(f"1. prefill {r.prefill_s:.2f}s, saved {r.path}: {r.file_bytes:,} bytes")
    # mlx-lm's own fp16 file for the same prompt, to compare sizes
    lm_cache = lm_make_cache(model)
    prefill(model, tokens, lm_cache)
    for c in lm_cache:
        c.keys, c.values = c.keys.astype(mx.float16), c.values.astype(mx.float16)
    with tempfile.TemporaryDirectory() as d:
        lm_path = os.path.join(d, "mlx_lm_fp16.safetensors")
        lm_save(lm_path, lm_cache)
        lm_size = os.path.getsize(lm_path)
    print(f"2. mlx-lm fp16 prompt cache file: {lm_size:,} bytes -> rvq is {lm_size / r.file_bytes:.2f}x smaller")
    print("3. rvqstore inspect:")
    cmd_inspect(argparse.Namespace(file=args.out, json=False))
    # continue: in this process from the in-memory reload, and via prefix resume
    question = list(tokenizer.encode(" In short, a scope is", add_special_tokens=False))
    t0 = time.perf_counter()
    res = resume(args.out, tokens + question, model, tokenizer=tokenizer, mode="resident")
    gen = greedy_tokens(model, res.cache, res.remaining, args.max_tokens)
    out = [next(gen)]  # MLX is lazy: the first token is when the load and decode really happen
    ttft = time.perf_counter() - t0
    out += list(gen)
    print(f"4. resumed {res.reused} cached tokens: first new token after {ttft:.2f}s (the prefill alone "
          f"took {r.prefill_s:.2f}s); continuation: {tokenizer.decode(out)!r}")
    again = load_prompt_cache(args.out, model=model, tokenizer=tokenizer)
    print(f"5. reload check: {len(again)} layers, {again[0].offset} tokens each, "
          f"{sum(c.nbytes for c in again):,} bytes held as packed codes")
    return 0
