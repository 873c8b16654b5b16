"""``rvqstore generate --store URL``: reuse the longest stored prefix of the prompt, compute the rest,
generate, and store the blocks the store lacked."""

from __future__ import annotations

import argparse
import sys
import time

from .options import encode_prompt, load_model, read_prompt
from .registry import CLIError


def generate_with_store(args: argparse.Namespace) -> int:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from ..codec import DEFAULT_BITS
    from ..store import DEFAULT_BLOCK_SIZE, PrefixStore, open_backend

    if args.max_tokens < 0:
        raise CLIError("--max-tokens must be >= 0", 2)
    text = read_prompt(args)
    backend = open_backend(args.store)  # a bad URL fails before the model loads
    model, tokenizer = load_model(args)
    store = PrefixStore(args.store, model=model, tokenizer=tokenizer, backend=backend,
                        bits=args.bits or DEFAULT_BITS, block_size=args.block_size or DEFAULT_BLOCK_SIZE)
    prompt = encode_prompt(tokenizer, text, args.chat)
    if not prompt:
        raise CLIError("the prompt has no tokens")
    t0 = time.perf_counter()
    n, cache = store.longest_prefix(prompt, max_tokens=len(prompt) - 1, mode=args.mode)
    if cache is None:
        from .. import make_prompt_cache

        n = 0

        cache = make_prompt_cache(model, bits=store.bits, seed=store.seed, residual=store.residual, mode=args.mode)
    t_lookup = time.perf_counter() - t0
    print(f"[reused {n} of {len(prompt)} prompt tokens from {store.url} in {t_lookup:.2f}s; "
          f"computing {len(prompt) - n}]", file=sys.stderr)
    generated: list[int] = []
    resp = None
    for resp in stream_generate(model, tokenizer, prompt=prompt[n:], max_tokens=args.max_tokens,
                                prompt_cache=cache, sampler=make_sampler(temp=args.temp)):
        generated.append(int(resp.token))
        print(resp.text, end="", flush=True)
    print()
    # the cache holds the prompt and the generated tokens it has run (put stores what it holds)
    r = store.put(prompt + generated, cache)
    print(f"[stored {r.new_tokens} new tokens in {r.new_blocks} blocks ({r.new_bytes:,} bytes); "
          f"{r.stored_before} were stored]", file=sys.stderr)
    if resp is not None:
        print(f"[{resp.generation_tokens} tokens, {resp.generation_tps:.1f} tokens/s, "
              f"prompt {resp.prompt_tps:.1f} tokens/s]", file=sys.stderr)
    return 0
