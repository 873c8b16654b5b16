"""CLI subcommands that run a model: ``cache-prompt``, ``generate`` and ``demo``."""

from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path

from .cli import CLIError, subcommand
from .codec import DEFAULT_BITS


def _parse_bits(text: str) -> tuple[int, int]:
    try:
        parts = [int(p) for p in text.split("+")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must look like 2+2 or 4, got {text!r}") from None
    if len(parts) == 1:
        parts.append(0)
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"bits must look like 2+2 or 4, got {text!r}")
    return parts[0], parts[1]


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or an mlx-lm model folder (default: the bundled SmolLM2-135M-Instruct)")


def _codec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bits", type=_parse_bits, default=DEFAULT_BITS,
                   help="bits per stage: 4+2 (default; see docs/quality.md), 2+2 (compact, ~4x smaller than fp16), 4+4 ...")
    p.add_argument("--residual", choices=("conditional", "shared"), default="conditional")
    p.add_argument("--seed", type=int, default=0, help="rotation seed")
    p.add_argument("--dense-window", type=int, default=0, help="recent tokens kept in full precision")


def _load(args: argparse.Namespace):
    from .blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()  # a model run wants the fast BLAS (re-executes once if it helps)
    from .model import load_model

    return load_model(args.model)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise CLIError("give --prompt or --prompt-file, not both", 2)
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            return sys.stdin.read()
        return Path(args.prompt_file).read_text(encoding="utf-8")
    if args.prompt is None:
        raise CLIError("a prompt is needed: --prompt TEXT or --prompt-file FILE ('-' for stdin)", 2)
    return args.prompt


def _encode(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return list(tokenizer.encode(text))


def _cache_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="file holding the prompt ('-' for stdin)")
    p.add_argument("-o", "--output", required=True, help="the .rvq file to write")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size in tokens")
    _model_args(p)
    _codec_args(p)


@subcommand("cache-prompt", help="run a prompt through the model and save its KV cache as .rvq",
            configure=_cache_prompt_args)
def cmd_cache_prompt(args: argparse.Namespace) -> int:
    from .generation import cache_prompt
    from .progress import ProgressBar

    text = _read_prompt(args)
    from .cache import RVQKVCache

    RVQKVCache(args.bits, args.seed, args.residual, dense_window=args.dense_window)  # bad settings fail now
    if args.chunk < 1:
        raise CLIError("--chunk must be >= 1", 2)
    model, tokenizer = _load(args)
    tokens = _encode(tokenizer, text, args.chat)
    if not tokens:
        raise CLIError("the prompt has no tokens")
    bar, sbar = ProgressBar("prefill"), ProgressBar("save")
    try:
        r = cache_prompt(model, tokenizer, tokens, args.output, bits=args.bits, seed=args.seed,
                         residual=args.residual, dense_window=args.dense_window, chunk=args.chunk,
                         metadata={"prompt_chars": str(len(text)), "chat": str(bool(args.chat)).lower()},
                         progress=bar, save_progress=sbar)
    finally:
        bar.close()
        sbar.close()
    print(f"cached {r.n_tokens} tokens in {r.path}: {r.file_bytes:,} bytes "
          f"(prefill {r.prefill_s:.2f}s, save {r.save_s:.2f}s)")
    return 0


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-cache", required=True, help="the .rvq file from cache-prompt")
    p.add_argument("--prompt", default=None, help="text to append after the cached prompt")
    p.add_argument("--prompt-file", default=None, help="file holding that text ('-' for stdin)")
    p.add_argument("--full-prompt", action="store_true",
                   help="the given text is the whole prompt: reuse its longest common prefix with the cache")
    p.add_argument("--chat", action="store_true", help="with --full-prompt: apply the chat template")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--mode", choices=("packed", "resident"), default="resident",
                   help="resident (default): decoded keys/values kept while generating; packed: least memory")
    _model_args(p)


@subcommand("generate", help="resume a cached prompt from .rvq and continue generating",
            configure=_generate_args)
def cmd_generate(args: argparse.Namespace) -> int:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from . import open as open_rvq
    from . import resume

    if args.max_tokens < 0:
        raise CLIError("--max-tokens must be >= 0", 2)
    with open_rvq(args.prompt_cache) as f:  # fail fast on a bad file, before loading the model
        stored = f.tokens()
    if stored is None:
        raise CLIError(f"{args.prompt_cache} stores no token ids; it cannot be resumed")
    model, tokenizer = _load(args)
    text = "" if (args.prompt is None and args.prompt_file is None) else _read_prompt(args)
    if args.full_prompt:
        prompt = _encode(tokenizer, text, args.chat)
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

    from . import load_prompt_cache, resume
    from .generation import cache_prompt, greedy_tokens, prefill

    args.model = None
    model, tokenizer = _load(args)
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
    from .cli import main as cli_main

    print("3. rvqstore inspect:")
    cli_main(["inspect", args.out])
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
