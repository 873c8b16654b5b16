"""Machine-code size of the tensor-core attention kernel, counted from a local compile (no GPU needed).

For each configuration the kernel's translation unit (as rvqstore hands it to NVRTC) is compiled with the
local ``nvcc -cubin -arch=sm_90a -Xptxas -v``; reported: the registers and spill bytes ptxas states, the
kernel's instructions (its ``.text`` section / 16 bytes, read with ``readelf``), and the instructions of one
copy of a tile's compute: the growth of the kernel when its tile loop calls the compute twice (the second call
on another tile index, so it is not merged with the first). The loop body is unrolled, so that growth is what
one tile costs in issued instructions (before predication); it is measured on the one-tile loop (``--ping 0``).
With a disassembler (``--nvdisasm``, or ``nvdisasm`` on PATH) also the tile loop's own instructions, from the
listing (with ``--ping 1`` a turn of two tiles). Both layouts of the kernel (``rows``: query rows
as the mma's rows; ``swap``: as its columns, up to 8 rows) and the launch bounds' threadgroups per SM can be
compared side by side:

    python tools/kernel_instructions.py --bits 2+2,4+2,4+4 --rows 4,8 --json tools/results/kernel-instructions-sm90.json
    python tools/kernel_instructions.py --bits 2+2,4+2,4+4 --rows 4,8 --layouts swap --quick 1,0 \
        --json tools/results/kernel-instructions-sm90-quick.json
    python tools/kernel_instructions.py --bits 2+2,4+2 --rows 4,8 --layouts swap --lds 0,1 --ping 0,1 \
        --nvdisasm /path/to/nvdisasm --json tools/results/kernel-instructions-sm90-lds.json

``--opcodes`` also counts the tile loop's opcodes, where a tile's issue slots go (``--stages`` the ring's depth; the
settings not given are the kernel's own):

    python tools/kernel_instructions.py --bits 2+2,4+2 --layouts swap --blocks 3,4 --lds 2,3 --stages 0,3 --opcodes \
        --nvdisasm /path/to/nvdisasm --json tools/results/kernel-opcodes-sm90.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from rvqstore.attention import kernel_mma  # noqa: E402

_INPUTS = (mx.float16, mx.float32, mx.float32, mx.bfloat16, mx.uint32, mx.uint32, mx.bfloat16, mx.uint32,
           mx.uint32, mx.uint32, mx.uint32, mx.uint32)
_CALLS = {"swap": "      compute_swap(tile, kwa, vwa, ka, va);", "rows": "      compute(tile, kwa, vwa, ka, va);"}


def source(bits: tuple[int, int], d: int, rows: int, swap: bool, blocks: int, setup: int = 1, i42: int = 1,
           lds: int = 1, ping: int = 1, stages: int = 0) -> str:
    """The translation unit of one configuration, as a host nvcc takes it."""
    old = kernel_mma.BLOCKS_PER_SM
    kernel_mma.BLOCKS_PER_SM = blocks
    try:
        k = kernel_mma._kernel()
    finally:
        kernel_mma.BLOCKS_PER_SM = old
    template = kernel_mma.template(bits[0], bits[1], d, rows, T_STRIDE=1, T_SWAP=int(swap), T_QUICK=setup, T_LATEN=1,
                                   T_QMAX=0, T_I42=i42, T_LDS=lds, T_PING=ping, T_L2PF=0, T_STAGES=stages, T_PROBE=0)
    _, tu = k.source_for(template, _INPUTS, (mx.float32, mx.float32))
    # NVRTC has no <stdint.h>; the host compiler does, and refuses these two typedefs again
    return tu.replace("typedef long long int64_t;", "").replace("typedef unsigned long long uint64_t;", "")


def compile_stats(tu: str, work: Path, name: str) -> dict:
    cu, cubin = work / f"{name}.cu", work / f"{name}.cubin"
    cu.write_text(tu)
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", str(cu), "-o", str(cubin)],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise SystemExit(f"nvcc failed for {name}:\n{r.stderr[-3000:]}")
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    sections = subprocess.run(["readelf", "-S", "-W", str(cubin)], capture_output=True, text=True).stdout
    text = [ln for ln in sections.splitlines() if re.search(r"\]\s+\.text\.", ln)]
    if len(text) != 1:
        raise SystemExit(f"expected one .text section in {cubin}, found {len(text)}")
    size = int(text[0].split()[5], 16)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "spill_load_bytes": int(spill.group(2)) if spill else None, "instructions": size // 16}


def tile_loop(cubin: Path, nvdisasm: str | None) -> list[str] | None:
    """The tile loop's instructions in ``nvdisasm``'s listing of ``cubin``: the shortest span from a label to a
    backward branch to it that holds every mma of the kernel (the shuffles' fallback blocks, placed at the end and
    branching back, span more); None without the disassembler."""
    if not nvdisasm:
        return None
    text = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    labels, ins = {}, []
    for line in text.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1))
    mma = [i for i, t in enumerate(ins) if "HMMA" in t]
    best = None
    for i, t in enumerate(ins):
        m = re.search(r"BRA\s.*?(\.L_x_\d+)", t)
        start = labels.get(m.group(1)) if m else None
        if start is not None and start <= i and mma and start <= mma[0] and mma[-1] <= i:
            if best is None or i + 1 - start < best[1] - best[0]:
                best = (start, i + 1)
    return ins[best[0]:best[1]] if best else None


def opcodes(loop: list[str]) -> dict:
    """How many of each opcode (its modifiers kept, its predicate dropped) the loop holds, most first: where a tile's
    issue slots go (ALU-pipe permutes and logic, the FMA pipe's multiply-adds, shared and global loads, mma)."""
    counts: dict = {}
    for t in loop:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def measure(bits, d, rows, layout, blocks, work: Path, quick: int = 1, i42: int = 1, lds: int = 1, ping: int = 1,
            nvdisasm: str | None = None, stages: int = 0, with_opcodes: bool = False) -> dict:
    tu = source(bits, d, rows, layout == "swap", blocks, quick, i42, lds, ping, stages)
    call = _CALLS[layout]
    name = f"b{bits[0]}{bits[1]}_d{d}_r{rows}_{layout}_tg{blocks}_q{quick}_i{i42}_l{lds}_p{ping}_s{stages}"
    one = compile_stats(tu, work, name)
    loop = tile_loop(work / f"{name}.cubin", nvdisasm)
    one["loop_instructions"] = len(loop) if loop is not None else None  # a two-tile turn with T_PING
    if with_opcodes and loop is not None:
        one["loop_opcodes"] = opcodes(loop)
    tile = None
    if not ping and not stages:  # the one-tile loop is the kernel's last call of the compute
        at = tu.rfind(call)
        if at < 0:
            raise SystemExit(f"the tile loop's call {call.strip()!r} is not in the kernel: update this tool")
        again = call.strip().replace("(tile, kwa, vwa, ka, va)", "(tile + 3u, kwa, vwa, kb, vb)")
        # one statement (an if/else branch)
        twice = tu[:at] + "      { " + call.strip() + " " + again + " }" + tu[at + len(call):]
        two = compile_stats(twice, work, name + "_twice")
        tile = two["instructions"] - one["instructions"]
    return {"bits": f"{bits[0]}+{bits[1]}", "d": d, "rows": rows, "layout": layout, "blocks_per_sm": blocks,
            "quick": quick, "i42": i42, "lds": lds, "ping": ping, "stages": stages, **one, "tile_compute_instructions": tile}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", default="2+2,4+2", help="comma list of B1+B2")
    ap.add_argument("--dims", default="128", help="comma list of head dims (64, 128)")
    ap.add_argument("--rows", default="4", help="comma list of query rows per KV head (<= 16)")
    ap.add_argument("--layouts", default="swap,rows", help="swap (up to 8 rows), rows")
    ap.add_argument("--blocks", default="3", help="comma list of threadgroups per SM in the launch bounds")
    ap.add_argument("--quick", default="1", help="comma list of T_QUICK values (1: the quick setup and warp merge, "
                    "kernel_mma.QUICK_SPLIT; 0: the first versions)")
    ap.add_argument("--i42", default="1", help="comma list of T_I42 values (1: 4+2 d128 table indices by bytes, "
                    "kernel_mma.BYTE_INDEX_42, the default; 0: one by one)")
    ap.add_argument("--lds", default=str(kernel_mma.SHARED_ADDRESS), help="comma list of T_LDS values "
                    "(kernel_mma.SHARED_ADDRESS, default the kernel's: 3 = 2+2's entries 256 bytes apart too, 2 = 4+2's "
                    "entries 256 bytes apart, 1 = table reads by 32-bit shared address, 0 = through the generic pointer)")
    ap.add_argument("--ping", default=str(int(kernel_mma.TILE_PAIRS)), help="comma list of T_PING values "
                    "(kernel_mma.TILE_PAIRS, default the kernel's: 1 = two tiles a loop turn, 0 = one)")
    ap.add_argument("--stages", default=str(kernel_mma.STAGES), help="comma list of T_STAGES values "
                    "(kernel_mma.STAGES, default the kernel's: 2-4 = a ring of that many tiles in shared memory, 0 = none)")
    ap.add_argument("--opcodes", action="store_true", help="also count the tile loop's opcodes (needs the disassembler)")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="the disassembler, for the tile loop's "
                    "instructions (default: on PATH; pip's nvidia-cuda-nvdisasm has one)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    for tool in ("nvcc", "readelf"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not on PATH (this tool compiles locally)")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for b, d, rows, layout, blocks, quick, i42, lds, ping, stages in itertools.product(
                a.bits.split(","), _ints(a.dims), _ints(a.rows), a.layouts.split(","), _ints(a.blocks),
                _ints(a.quick), _ints(a.i42), _ints(a.lds), _ints(a.ping), _ints(a.stages)):
            if layout == "swap" and rows > 8:
                continue
            bits = tuple(int(x) for x in b.split("+"))
            row = measure(bits, d, rows, layout, blocks, Path(tmp), quick, i42, lds, ping, a.nvdisasm, stages,
                          a.opcodes)
            out.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        meta = {"command": "python tools/kernel_instructions.py " + " ".join(sys.argv[1:]),
                "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1],
                "rows": out}
        Path(a.json).write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
