#!/usr/bin/env python3
"""Fuzz the ``.rvq`` reader: every input must give a typed FormatError or a correct load.

    python tools/fuzz_format.py                      # hypothesis, 2000 examples per strategy
    python tools/fuzz_format.py --examples 20000
    python tools/fuzz_format.py --atheris [ARGS...]  # coverage-guided, if atheris is installed

Seeds are the valid test vectors in ``format_spec/vectors/valid`` and real snapshots written by
``save_prompt_cache`` (attention layers with dense tails and zstd, a wrapped sliding window, a
recurrent state, a cache with codec state: sink positions and a key mean).  Two kinds of mutation:

* byte level: bit flips, overwritten ranges, inserted/deleted/truncated/appended bytes;
* header level: decode the header, replace a value somewhere (by a hostile integer, a wrong type, a
  huge count, ...), re-encode it and fix every length and checksum, so that the mutation reaches the
  schema and layout checks instead of stopping at the header checksum.

:func:`load_everything` is the property: it opens the file, verifies every section (checksums,
padding, zstd frames), reads every layer and decodes the codes with the codec; a file with codec
state (format 1.2) is then loaded into caches too (``load_prompt_cache``: sinks, key mean and codes
checked together by the cache).  It returns ``"ok"`` or the name of the :class:`FormatError`
subclass raised; any other exception propagates (a bug).
The tests (``tests/test_format_fuzz.py``, ``tests/test_format_mutations.py``) use the same functions.
"""

from __future__ import annotations

import argparse
import copy
import os
import struct
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rvqstore.format import FormatError, open_rvq  # noqa: E402
from rvqstore.format import constants as C  # noqa: E402

VALID_DIR = ROOT / "format_spec" / "vectors" / "valid"


def snapshot_seeds() -> dict[str, bytes]:
    """Real snapshots written by ``save_prompt_cache``: RVQ attention layers with a dense tail and zstd
    sections, a sliding-window layer that has wrapped, and a recurrent state (format 1.1)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    import rvqstore

    out = {}
    with tempfile.TemporaryDirectory() as d:
        k = mx.random.normal((1, 2, 12, 32), key=mx.random.key(1)).astype(mx.float16)
        plain = rvqstore.RVQKVCache(bits=(2, 2), dense_window=3)
        plain.update_and_fetch(k, k * 0.5)
        p = os.path.join(d, "a.rvq")
        rvqstore.save_prompt_cache(p, [plain], tokens=list(range(12)), compress="auto")
        out["snapshot_rvq_dense_tail.rvq"] = Path(p).read_bytes()
        ring = RotatingKVCache(max_size=6, keep=1)
        ring.update_and_fetch(k, k)
        state = ArraysCache(2)
        state[0] = mx.ones((1, 3), dtype=mx.bfloat16)
        state[1] = mx.arange(8, dtype=mx.float32).reshape(1, 2, 4)
        attn = rvqstore.RVQKVCache(bits=(4, 2))
        attn.update_and_fetch(k, k)
        p = os.path.join(d, "b.rvq")
        rvqstore.save_prompt_cache(p, [attn, ring, state], tokens=list(range(12)), bits=(2, 1))
        out["snapshot_kinds.rvq"] = Path(p).read_bytes()
        centered = rvqstore.RVQKVCache(bits=(2, 2), dense_window=2, flush_block=4, sink_tokens=2, center_keys=True)
        centered.update_and_fetch(k + 0.5, k * 0.5)
        p = os.path.join(d, "c.rvq")
        rvqstore.save_prompt_cache(p, [centered], tokens=list(range(12)), compress="auto")
        out["snapshot_codec_state.rvq"] = Path(p).read_bytes()
    return out


def seeds(*, snapshots: bool = True) -> dict[str, bytes]:
    """The valid test vectors, and (by default) real snapshots of the library's own saves."""
    out = {p.name: p.read_bytes() for p in sorted(VALID_DIR.glob("*.rvq"))}
    if snapshots:
        out.update(snapshot_seeds())
    return out


def load_everything(path: str | os.PathLike, *, decode: bool = True) -> str:
    """Open, verify, read every layer (and decode with the codec); "ok" or the FormatError's class name."""
    try:
        with open_rvq(path) as f:
            if decode:
                from rvqstore.format.quantizer import decode_layers

                f.verify(decode=decode_layers)
            else:
                f.verify()
            for layer in f.layers:
                f.layer_arrays(layer.index)
            f.tokens()
            state = "codec-state" in f.header.required_features
        if decode and state:  # sinks and mean reach the cache: a typed error or caches, nothing else
            from rvqstore import load_prompt_cache

            load_prompt_cache(path)
        return "ok"
    except FormatError as e:
        assert str(e).startswith(os.fspath(path)), f"error message does not name the file: {e}"
        return type(e).__name__


def load_bytes(data: bytes, workdir: str, *, decode: bool = True, max_alloc: int | None = None) -> str:
    """:func:`load_everything` on ``data`` written to a file in ``workdir``; optionally checks that the
    peak of Python-tracked allocations stays under ``max_alloc`` bytes."""
    p = os.path.join(workdir, "fuzz.rvq")
    with open(p, "wb") as fh:
        fh.write(data)
    if max_alloc is None:
        return load_everything(p, decode=decode)
    # the container work (everything but the codec, whose first use builds tables and caches) is
    # measured; then the codec decodes, if asked
    tracemalloc.start()
    try:
        out = load_everything(p, decode=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= max_alloc, f"peak allocation {peak} bytes for a {len(data)}-byte file (outcome {out})"
    if decode and out == "ok":
        out = load_everything(p, decode=True)
    return out


# ---- header-level mutation ---------------------------------------------------------------------------------
HOSTILE_INTS = [-1, -(1 << 63), 0, 1, 63, 64, 65, 255, 256, (1 << 16), (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
                1 << 32, 1 << 40, (1 << 40) + 1, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
HOSTILE_VALUES: list[Any] = HOSTILE_INTS + [None, True, False, 0.5, float("nan"), float("inf"), "", "x" * 300,
                                            "tokens", b"", b"\x00" * 9, [], [0], [1 << 40] * 4, {}, {"a": 1}]


def split(data: bytes) -> tuple[dict, bytes]:
    """(decoded header, preamble bytes) of a valid file."""
    h_off, h_len = struct.unpack_from("<QQ", data, 16)
    return msgpack.unpackb(data[h_off: h_off + h_len], raw=False), data[:64]


def rebuild(data: bytes, header: Any, *, raw_header: bytes | None = None) -> bytes:
    """``data`` with its header replaced by ``header`` (re-encoded), lengths and checksums fixed."""
    h_off = struct.unpack_from("<Q", data, 16)[0]
    hb = raw_header if raw_header is not None else msgpack.packb(header, use_bin_type=True)
    body = bytearray(data[:h_off]) + hb
    struct.pack_into("<QQQ", body, 24, len(hb), xxhash.xxh3_64_intdigest(hb), len(body))
    struct.pack_into("<Q", body, 56, xxhash.xxh3_64_intdigest(bytes(body[:56])))
    return bytes(body)


def paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indices) to a value inside ``obj``."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out.extend(paths(v, prefix + (k,)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append(prefix + (i,))
            out.extend(paths(v, prefix + (i,)))
    return out


def set_path(obj: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def del_path(obj: Any, path: tuple) -> None:
    for k in path[:-1]:
        obj = obj[k]
    del obj[path[-1]]


# ---- hypothesis strategies ------------------------------------------------------------------------------
def strategies():
    from hypothesis import strategies as st

    seed_items = sorted(seeds().items())

    @st.composite
    def byte_mutation(draw):
        name, data = draw(st.sampled_from(seed_items))
        b = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "append", "splice"]))
            n = len(b)
            if op == "flip" and n:
                i = draw(st.integers(0, n - 1))
                b[i] ^= 1 << draw(st.integers(0, 7))
            elif op == "set" and n:
                i = draw(st.integers(0, n - 1))
                chunk = draw(st.binary(min_size=1, max_size=16))
                b[i: i + len(chunk)] = chunk
            elif op == "insert":
                i = draw(st.integers(0, n))
                b[i:i] = draw(st.binary(min_size=1, max_size=64))
            elif op == "delete" and n:
                i = draw(st.integers(0, n - 1))
                del b[i: i + draw(st.integers(1, 64))]
            elif op == "truncate":
                del b[draw(st.integers(0, n)):]
            elif op == "append":
                b += draw(st.binary(min_size=1, max_size=128))
            elif op == "splice" and n > 8:
                i, j = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2)))
                b[i:j] = bytes(reversed(b[i:j]))
        return name, bytes(b)

    @st.composite
    def header_mutation(draw):
        name, data = draw(st.sampled_from(seed_items))
        header, _ = split(data)
        for _ in range(draw(st.integers(1, 3))):
            ps = paths(header)
            if not ps:
                break
            p = draw(st.sampled_from(ps))
            op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "dup_list"]))
            try:
                if op == "replace":
                    set_path(header, p, copy.deepcopy(draw(st.sampled_from(HOSTILE_VALUES))))
                elif op == "delete":
                    del_path(header, p)
                else:
                    parent = header
                    for k in p[:-1]:
                        parent = parent[k]
                    if isinstance(parent, list):
                        parent.append(copy.deepcopy(parent[p[-1]]))
            except (KeyError, IndexError, TypeError):
                pass
        return name, rebuild(data, header)

    return byte_mutation(), header_mutation()


def run_hypothesis(examples: int) -> None:
    from hypothesis import HealthCheck, given, settings

    byte_mut, header_mut = strategies()
    tmp = tempfile.mkdtemp(prefix="rvq-fuzz-")
    originals = seeds()

    for label, strat in (("bytes", byte_mut), ("header", header_mut)):
        outcomes: dict[str, int] = {}
        check = _counter(outcomes, tmp, originals, label == "bytes")
        given(strat)(settings(max_examples=examples, deadline=None, database=None,
                              suppress_health_check=list(HealthCheck))(check))()
        print(f"{label}: {sum(outcomes.values())} cases, outcomes {dict(sorted(outcomes.items()))}")


def _counter(outcomes: dict, tmp: str, originals: dict, byte_level: bool):
    def check(case):
        out = check_case(case, tmp, originals, byte_level)
        outcomes[out] = outcomes.get(out, 0) + 1
    return check


def check_case(case: tuple[str, bytes], workdir: str, originals: dict[str, bytes], byte_level: bool) -> str:
    """The fuzz property for one mutated file: a typed error or a load (never another exception), with
    Python-tracked allocations under 40x the file size (or 4 MiB).  For byte-level mutations a load
    is only allowed if the bytes still equal the seed: every byte of a valid file is covered by a
    checksum or must be zero padding, so any real damage must be detected.  (Header-level
    mutations re-checksum the header, and may legitimately load, e.g. a changed metadata value.)"""
    name, data = case
    out = load_bytes(data, workdir, max_alloc=max(1 << 22, 40 * len(data)))
    if out == "ok" and byte_level:
        assert data == originals[name], f"a damaged copy of {name} loaded without error"
    return out


def run_atheris(argv: list[str]) -> None:  # pragma: no cover - optional dependency
    import atheris

    tmp = tempfile.mkdtemp(prefix="rvq-atheris-")
    seed_list = list(seeds().values())

    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        base = seed_list[fdp.ConsumeIntInRange(0, len(seed_list) - 1)]
        mutated = bytearray(base)
        for _ in range(fdp.ConsumeIntInRange(0, 8)):
            if not mutated:
                break
            i = fdp.ConsumeIntInRange(0, len(mutated) - 1)
            mutated[i] = fdp.ConsumeInt(1) & 0xFF
        tail = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        load_bytes(bytes(mutated) + (tail if fdp.ConsumeBool() else b""), tmp)

    atheris.Setup([sys.argv[0]] + argv, one)
    atheris.Fuzz()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="fuzz the .rvq reader")
    ap.add_argument("--examples", type=int, default=2000, help="hypothesis examples per strategy")
    ap.add_argument("--atheris", action="store_true", help="use atheris (remaining args go to libFuzzer)")
    args, rest = ap.parse_known_args(argv)
    if args.atheris:
        run_atheris(rest)
    else:
        run_hypothesis(args.examples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
