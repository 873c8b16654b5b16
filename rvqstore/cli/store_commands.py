"""CLI subcommands of the prefix store: ``store ls | du | gc | verify`` (no model needed)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from .registry import subcommand

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)


def parse_size(text: str) -> int:
    """``1000``, ``500M``, ``2G``, ``1.5GiB`` -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"a size looks like 1000, 500M or 2G, got {text!r}")
    n = float(m.group(1)) * 1024 ** "_kmgt".index(m.group(2).lower() or "_")
    return int(n)


def _store_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="store_command", metavar="ACTION", parser_class=type(p))
    sub.required = True
    ls = sub.add_parser("ls", help="namespaces of a store: model, codec, blocks, bytes, tokens, prompts")
    du = sub.add_parser("du", help="bytes a store holds")
    gc = sub.add_parser("gc", help="remove orphaned blocks, then least recently used ones to fit a budget")
    gc.add_argument("--max-bytes", type=parse_size, default=None, help="budget, e.g. 20G (default: orphans only)")
    gc.add_argument("--dry-run", action="store_true", help="print what would go, remove nothing")
    ve = sub.add_parser("verify", help="read every block and check every byte; exit status 1 if any is bad")
    ve.add_argument("--decode", action="store_true", help="also decode every code with the codec")
    ve.add_argument("--repair", action="store_true", help="remove the bad blocks (the next put rewrites them)")
    for q in (ls, du, gc, ve):
        q.add_argument("url", help="a directory or s3://bucket/prefix (S3: AWS_ENDPOINT_URL, AWS_* credentials)")
        q.add_argument("--json", action="store_true", help="one JSON object")


def _open(url: str):
    from ..store import open_backend

    return open_backend(url)


@subcommand("store", help="inspect and maintain a prefix store (ls, du, gc, verify)", configure=_store_args)
def cmd_store(args: argparse.Namespace) -> int:
    backend = _open(args.url)
    return {"ls": _ls, "du": _du, "gc": _gc, "verify": _verify}[args.store_command](backend, args)


def _emit(obj) -> None:
    json.dump(obj, sys.stdout, indent=1)
    sys.stdout.write("\n")


def _ls(backend, args) -> int:
    from ..store.inspection import describe_store

    d = describe_store(backend)
    if args.json:
        _emit(d)
        return 0
    print(f"store {d['url']}: {len(d['namespaces'])} namespace(s), {d['block_bytes']:,} bytes of blocks")
    for n in d["namespaces"]:
        m = n["model"] or {}
        codec = n["codec"] or {}
        bits = "+".join(map(str, codec.get("bits", []))) or "?"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(n["last_used"])) if n["last_used"] else "-"
        print(f"  {n['namespace']}  model {m.get('model_type', '?')} {m.get('num_layers', '?')} layers "
              f"(weights {str(m.get('weights_sha256', '?'))[:12]}), bits {bits}, block {n['block_size']} tokens")
        print(f"    {n['blocks']:,} blocks, {n['tokens']:,} tokens, {n['bytes']:,} bytes, {n['leaves']:,} prompt "
              f"ends, longest prefix {n['longest_prefix']:,} tokens, orphans {n['orphans']}, last used {when}")
    return 0


def _du(backend, args) -> int:
    from ..store import scan

    idx = scan(backend)
    per = {ns: sum(b.size for b in bl) for ns, bl in idx.by_namespace().items()}
    if args.json:
        _emit({"url": backend.url, "block_bytes": idx.block_bytes, "total_bytes": idx.total_bytes,
               "namespaces": per})
        return 0
    for ns, n in sorted(per.items()):
        print(f"{n:>16,}  {ns}")
    print(f"{idx.total_bytes:>16,}  total ({idx.block_bytes:,} in {len(idx.blocks):,} blocks)")
    return 0


def _gc(backend, args) -> int:
    from ..store.index import plan_gc, run_gc, scan

    if args.dry_run:
        plan = plan_gc(scan(backend), args.max_bytes)
    else:
        plan = run_gc(backend, args.max_bytes)
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        _emit({"removed_blocks": len(plan.evict) + len(plan.orphans), "orphans": len(plan.orphans),
               "freed_bytes": plan.free_bytes, "kept_bytes": plan.keep_bytes, "dry_run": args.dry_run})
        return 0
    print(f"{verb} {len(plan.evict) + len(plan.orphans):,} blocks ({len(plan.orphans)} orphaned), "
          f"{plan.free_bytes:,} bytes; {plan.keep_bytes:,} bytes of blocks kept")
    return 0


def _verify(backend, args) -> int:
    from ..store.inspection import verify_store

    r = verify_store(backend, repair=args.repair, decode=args.decode)
    if args.json:
        _emit({"checked": r.checked, "bytes": r.bytes, "bad": [{"path": p, "reason": w} for p, w in r.bad],
               "orphans": r.orphans, "repaired": bool(args.repair and r.bad)})
    else:
        for p, why in r.bad:
            print(f"BAD {p}: {why}" + (" (removed)" if args.repair else ""))
        print(f"{'OK' if not r.bad else 'FAILED'} {backend.url}: {r.checked:,} blocks, {r.bytes:,} bytes checked, "
              f"{len(r.bad)} bad, {len(r.orphans)} orphaned")
    return 1 if r.bad else 0
