"""Options and helpers shared by the CLI commands that run a model (prompt text, model, codec)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .registry import CLIError


def parse_bits(text: str) -> tuple[int, int]:
    try:
        parts = [int(p) for p in text.split("+")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must look like 2+2 or 4, got {text!r}") from None
    if len(parts) == 1:
        parts.append(0)
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"bits must look like 2+2 or 4, got {text!r}")
    return parts[0], parts[1]


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or an mlx-lm model folder (default: the bundled SmolLM2-135M-Instruct)")


def parse_preset(text: str) -> str:
    from ..errors import CodecConfigError
    from ..presets import get

    try:
        return get(text).name
    except CodecConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def codec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bits", type=parse_bits, default=None,
                   help="bits per stage: 4+2 (default; see docs/quality.md), 2+2 (compact, ~4x smaller than fp16), 4+4 ...")
    p.add_argument("--preset", type=parse_preset, default=None,
                   help="instead of --bits, settings named by what they promise on disk: small (<= 3 bits/coord), "
                        "balanced (<= 4.5), near-lossless (<= 6); see docs/quality.md")
    p.add_argument("--profile", default=None,
                   help="with --preset: a sensitivity profile of the model (tools/probe_sensitivity.py) to allocate "
                        "bits per layer too")
    p.add_argument("--residual", choices=("conditional", "shared"), default="conditional")
    p.add_argument("--seed", type=int, default=0, help="rotation seed")
    p.add_argument("--dense-window", type=int, default=0, help="recent tokens kept in full precision")


def load_model(args: argparse.Namespace):
    from ..blas import maybe_reexec_with_openblas, slow_blas_advice

    maybe_reexec_with_openblas()  # a model run wants the fast BLAS (re-executes once if it helps)
    advice = slow_blas_advice()
    if advice:  # a fresh machine without OpenBLAS: say why the prefill will crawl and what fixes it
        print(f"warning: {advice}", file=sys.stderr)
    from ..model import load_model

    return load_model(args.model)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise CLIError("give --prompt or --prompt-file, not both", 2)
    if args.prompt_file is not None:
        if args.prompt_file == "-":
            return sys.stdin.read()
        return Path(args.prompt_file).read_text(encoding="utf-8")
    if args.prompt is None:
        raise CLIError("a prompt is needed: --prompt TEXT or --prompt-file FILE ('-' for stdin)", 2)
    return args.prompt


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return list(tokenizer.encode(text))
