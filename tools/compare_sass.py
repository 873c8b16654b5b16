"""The tensor-core attention kernel's machine code at two checkouts, compared configuration by configuration.

For source changes meant to leave some configurations alone (a new template setting, off by default): each
configuration's translation unit is made by the checkout's own ``rvqstore`` and ``kernels`` (the reference run in a
child process that sees the reference checkout and not this one: ``python -S`` with the reference and the
environment's site-packages on its path, so an editable install of this checkout does not shadow it), compiled
with the local ``nvcc -arch=sm_90a -cubin`` and disassembled with ``nvdisasm -hex``; the instructions and their
encodings are compared with the kernel's name masked.

    python tools/compare_sass.py --ref .gpu/oldtree [--nvdisasm PATH] [--bits 2+2,4+2,4+4] [--rows 4,8,16]
    python tools/compare_sass.py --ref .gpu/oldtree --kernel append   # the append kernel's four variants
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def _append_code(bits: tuple[int, int], variant: int) -> str:
    """Python that prints the append kernel's translation unit (``variant``: 0 plain, 1 resident, 2 in place, 3 resident
    in place) at head dim 128, fp16, as the checkout on ``sys.path`` builds it."""
    return f"""
import mlx.core as mx
from rvqstore import cache_append
from rvqstore.codec import RVQCodec
resident, inplace = bool({variant} & 1), bool({variant} & 2)
s = cache_append._Setup(RVQCodec(128, {bits!r}))
ins = (mx.float16, mx.float16, mx.float32, mx.float32, mx.float32, mx.float32, mx.uint32)
if inplace:
    ins += (mx.uint32, mx.bfloat16, mx.uint32, mx.uint32, mx.bfloat16, mx.uint32, mx.uint32)
outs = ((mx.uint32,) if inplace else (mx.bfloat16, mx.uint32, mx.uint32) * 2) + ((mx.float16,) * 2 if resident else ())
t = s.template + [("InT", mx.float16)] + ([("T_DONE", 4)] if inplace else [])
_, tu = cache_append._kernel(resident, False, inplace).source_for(t, ins, outs)
"""


def sass(tree: str, bits: tuple[int, int], rows: int, fused: bool, work: Path, nvdisasm: str,
         kernel: str = "mma") -> str:
    """The configuration's instructions (default settings of this kernel, T_LDS 2; ``kernel`` "append": the append
    kernel's, ``rows`` then its variant) as ``tree`` builds them."""
    code = _append_code(bits, rows) if kernel == "append" else f"""
import mlx.core as mx
from rvqstore.attention import kernel_mma
ins = (mx.float16, mx.float32, mx.float32, mx.bfloat16, mx.uint32, mx.uint32, mx.bfloat16, mx.uint32, mx.uint32,
       mx.uint32, mx.uint32, mx.uint32) + ((mx.float32, mx.uint32) if {fused} else ())
outs = (mx.float32, mx.float32) + ((mx.float16,) if {fused} else ())
t = [("T_B1", {bits[0]}), ("T_B2", {bits[1]}), ("T_D", 128), ("T_R", {rows}), ("T_STRIDE", 1), ("T_SWAP", 1),
     ("T_QUICK", 1), ("T_LATEN", 1), ("T_QMAX", 0), ("T_I42", 1), ("T_LDS", 2), ("T_PING", 0)]
t += [(n, 0) for n in ("T_L2PF", "T_STAGES") if n in kernel_mma.sources()[1]]  # settings newer checkouts have, off
t += [("T_PROBE", 0)]
t += [("OutT", mx.float16)] if {fused} else []
_, tu = kernel_mma._kernel({fused}).source_for(t, ins, outs)
"""
    code = f"""
import sys
sys.path[:0] = {[tree] + site.getsitepackages()!r}
{code}
print(tu.replace("typedef long long int64_t;", "").replace("typedef unsigned long long uint64_t;", ""))
"""
    tu = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True).stdout
    name = f"{Path(tree).name}_{kernel}_{int(fused)}_{bits[0]}{bits[1]}_{rows}"
    cu, cubin = work / f"{name}.cu", work / f"{name}.cubin"
    cu.write_text(tu)
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", str(cu), "-o", str(cubin)], check=True,
                   capture_output=True)
    text = subprocess.run([nvdisasm, "-hex", str(cubin)], capture_output=True, text=True, check=True).stdout
    return "\n".join(re.sub(r"rvq_\w+", "KERNEL", line) for line in text.splitlines() if "/*" in line and ";" in line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="the reference checkout (its rvqstore/ and kernels/)")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    ap.add_argument("--bits", default="2+2,4+2,4+4")
    ap.add_argument("--rows", default="4,8,16")
    ap.add_argument("--kernel", choices=("mma", "append"), default="mma",
                    help="append: the append kernel's plain, resident, in-place and resident in-place variants")
    ap.add_argument("--json", help="write the verdicts here")
    a = ap.parse_args(argv)
    if not a.nvdisasm or not shutil.which("nvcc"):
        raise SystemExit("needs nvcc and nvdisasm (pip download nvidia-cuda-nvdisasm)")
    rows = []
    append = a.kernel == "append"
    with tempfile.TemporaryDirectory() as tmp:
        for fused in ((False,) if append else (False, True)):
            for b in a.bits.split(","):
                bits = tuple(int(x) for x in b.split("+"))
                for r in (range(4) if append else (int(x) for x in a.rows.split(","))):
                    ref = sass(str(Path(a.ref).resolve()), bits, r, fused, Path(tmp), a.nvdisasm, a.kernel)
                    new = sass(str(_ROOT), bits, r, fused, Path(tmp), a.nvdisasm, a.kernel)
                    what = ("append", ("plain", "resident", "inplace", "resident-inplace")[r]) if append else \
                        ("fused" if fused else "split", r)
                    rows.append({"kernel": what[0], "bits": b, ("variant" if append else "rows"): what[1],
                                 "instructions": len(new.splitlines()), "identical": ref == new})
                    print(json.dumps(rows[-1]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"ref": a.ref, "rows": rows}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
