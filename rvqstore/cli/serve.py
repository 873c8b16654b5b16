"""``rvqstore serve``: mlx-lm's HTTP server with its prompt cache backed by a prefix store."""

from __future__ import annotations

import argparse

from .options import parse_bits
from .registry import subcommand
from .store_commands import parse_size


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.epilog = ("Every other option is mlx-lm's server's own (--model, --host, --port, --prompt-cache-size, ...; "
                "see `mlx_lm.server --help`). Without --model the bundled SmolLM2-135M-Instruct is served.")
    p.add_argument("--store", required=True, metavar="URL", help="a directory or s3://bucket/prefix")
    p.add_argument("--store-bits", type=parse_bits, default=None, help="codec bits of stored blocks (default 4+2)")
    p.add_argument("--store-block-size", type=int, default=None, help="tokens per stored block (default 256)")
    p.add_argument("--store-max-bytes", type=parse_size, default=None,
                   help="keep the store within this many bytes (LRU gc as it grows), e.g. 20G")


@subcommand("serve", help="mlx-lm's server with a persistent, shared prompt cache (a prefix store)",
            configure=_serve_args, passthrough=True)
def cmd_serve(args: argparse.Namespace) -> int:
    from ..blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    from ..store import open_backend
    from ..store.mlx_server import run_server

    open_backend(args.store)  # a bad URL fails now, not at the first request
    opts = {}
    if args.store_bits is not None:
        opts["bits"] = args.store_bits
    if args.store_block_size is not None:
        opts["block_size"] = args.store_block_size
    run_server(args.store, list(args.passthrough), store_options=opts, max_store_bytes=args.store_max_bytes)
    return 0
