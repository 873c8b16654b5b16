"""CLI subcommands that run a model on a prompt: ``cache-prompt`` and ``generate``."""

from __future__ import annotations

import argparse
import sys
import time

from .options import codec_args, encode_prompt, load_model, model_args, parse_bits, read_prompt
from .registry import CLIError, subcommand


def _cache_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="file holding the prompt ('-' for stdin)")
    p.add_argument("-o", "--output", required=True, help="the .rvq file to write")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size in tokens")
    model_args(p)
    codec_args(p)


@subcommand("cache-prompt", help="run a prompt through the model and save its KV cache as .rvq",
            configure=_cache_prompt_args)
def cmd_cache_prompt(args: argparse.Namespace) -> int:
    from ..generation import cache_prompt
    from ..progress import ProgressBar

    text = read_prompt(args)
    from ..cache import RVQKVCache
    from ..codec import DEFAULT_BITS

    if args.preset is not None and args.bits is not None:
        raise CLIError("give --bits or --preset, not both", 2)
    if args.profile is not None and args.preset is None:
        raise CLIError("--profile allocates the bits of a --preset: give one", 2)
    if args.profile is not None:
        from ..bit_allocation import load_profile

        load_profile(args.profile)  # a bad profile fails now, before the model loads
    bits = args.bits or DEFAULT_BITS
    RVQKVCache(bits, args.seed, args.residual, dense_window=args.dense_window)  # bad settings fail now
    if args.chunk < 1:
        raise CLIError("--chunk must be >= 1", 2)
    model, tokenizer = load_model(args)
    tokens = encode_prompt(tokenizer, text, args.chat)
    if not tokens:
        raise CLIError("the prompt has no tokens")
    bar, sbar = ProgressBar("prefill"), ProgressBar("save")
    metadata = {"prompt_chars": str(len(text)), "chat": str(bool(args.chat)).lower()}
    try:
        if args.preset is not None:
            r = _cache_prompt_with_preset(args, model, tokenizer, tokens, metadata, bar, sbar)
        else:
            r = cache_prompt(model, tokenizer, tokens, args.output, bits=bits, seed=args.seed,
                             residual=args.residual, dense_window=args.dense_window, chunk=args.chunk,
                             metadata=metadata, progress=bar, save_progress=sbar)
    finally:
        bar.close()
        sbar.close()
    print(f"cached {r.n_tokens} tokens in {r.path}: {r.file_bytes:,} bytes "
          f"(prefill {r.prefill_s:.2f}s, save {r.save_s:.2f}s)")
    return 0


def _cache_prompt_with_preset(args, model, tokenizer, tokens, metadata, bar, sbar):
    """cache-prompt with the caches of a preset (per-side bits; per-layer too with --profile), saved
    with the compress mode its budget is measured with ("best" for uniform-grid codes)."""
    import os

    from .. import presets, save_prompt_cache
    from ..generation import CachedPrompt, prefill

    cache = presets.make_cache(model, args.preset, profile=args.profile, seed=args.seed, residual=args.residual,
                               dense_window=args.dense_window)
    t0 = time.perf_counter()
    prefill(model, tokens, cache, chunk=args.chunk, progress=bar)
    t1 = time.perf_counter()
    size = save_prompt_cache(args.output, cache, tokens=tokens, model=model, tokenizer=tokenizer,
                             metadata={**metadata, "preset": args.preset}, progress=sbar,
                             compress=presets.get(args.preset).compress(args.profile))
    return CachedPrompt(os.fspath(args.output), len(tokens), size, t1 - t0, time.perf_counter() - t1)


def _generate_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-cache", help="the .rvq file from cache-prompt")
    src.add_argument("--store", metavar="URL",
                     help="a prefix store (directory or s3://bucket/prefix): the text is the whole prompt; its longest "
                          "stored prefix is reused, the rest computed, and the new blocks stored")
    p.add_argument("--block-size", type=int, default=None, help="with --store: tokens per block (default 256)")
    p.add_argument("--bits", type=parse_bits, default=None, help="with --store: codec bits of the stored blocks (default 4+2)")
    p.add_argument("--prompt", default=None, help="text to append after the cached prompt")
    p.add_argument("--prompt-file", default=None, help="file holding that text ('-' for stdin)")
    p.add_argument("--full-prompt", action="store_true",
                   help="the given text is the whole prompt: reuse its longest common prefix with the cache")
    p.add_argument("--chat", action="store_true", help="with --full-prompt: apply the chat template")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--mode", choices=("packed", "resident"), default="resident",
                   help="resident (default): decoded keys/values kept while generating; packed: least memory")
    model_args(p)


@subcommand("generate", help="resume a cached prompt from .rvq and continue generating",
            configure=_generate_args)
def cmd_generate(args: argparse.Namespace) -> int:
    if args.store is not None:
        from .store_generate import generate_with_store

        return generate_with_store(args)
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .. import open as open_rvq
    from .. import resume

    if args.max_tokens < 0:
        raise CLIError("--max-tokens must be >= 0", 2)
    with open_rvq(args.prompt_cache) as f:  # fail fast on a bad file, before loading the model
        stored = f.tokens()
        made_with = (f.model or {}).get("source")
    if stored is None:
        raise CLIError(f"{args.prompt_cache} stores no token ids; it cannot be resumed")
    if args.model is None and isinstance(made_with, str) and not made_with.startswith("bundled "):
        # made with another model than the default one: say which, before loading the wrong one
        raise CLIError(f"{args.prompt_cache} was made with the model {made_with!r}; pass --model {made_with}")
    model, tokenizer = load_model(args)
    text = "" if (args.prompt is None and args.prompt_file is None) else read_prompt(args)
    if args.full_prompt:
        prompt = encode_prompt(tokenizer, text, args.chat)
    else:
        prompt = [int(t) for t in stored] + (list(tokenizer.encode(text, add_special_tokens=False)) if text else [])
    t0 = time.perf_counter()
    r = resume(args.prompt_cache, prompt, model, tokenizer=tokenizer, mode=args.mode)
    t_resume = time.perf_counter() - t0
    print(f"[reused {r.reused} of {len(prompt)} prompt tokens from {args.prompt_cache} in {t_resume:.2f}s; "
          f"computing {len(r.remaining)}]", file=sys.stderr)
    resp = None
    for resp in stream_generate(model, tokenizer, prompt=r.remaining, max_tokens=args.max_tokens,
                                prompt_cache=r.cache, sampler=make_sampler(temp=args.temp)):
        print(resp.text, end="", flush=True)
    print()
    if resp is not None:
        print(f"[{resp.generation_tokens} tokens, {resp.generation_tps:.1f} tokens/s, "
              f"prompt {resp.prompt_tps:.1f} tokens/s]", file=sys.stderr)
    return 0
