"""Settings of the attention kernel (rvqstore/attention/kernel.py) by name, for same-run comparisons in the
benchmarks: ``first`` = the first kernel's layout (one thread per token in the key phase, no pair tables,
code words read straight from memory); ``nopair`` = no pair tables; ``nostage`` = code words not staged in
shared memory; ``v4``/``v8`` = 4/8 coordinates per thread in the value phase; ``klN`` = N lanes per token in
the key phase; ``simt`` = the SIMT kernel where the tensor-core one would serve (kernel_mma.TENSOR_CORES off);
``mma`` = the tensor-core kernel where it serves (kernel_mma.TENSOR_CORES on, the default); ``chunked`` = the tensor-core kernel with a contiguous chunk of tokens per split
(kernel_mma.STRIDED off; implies ``mma``); ``swap`` / ``noswap`` = the tensor-core kernel with the query rows as the
mma's columns where there are up to 8 (kernel_mma.SWAPPED, the default) / always as its rows; ``occ4`` = the
tensor-core kernel with registers budgeted for 4 threadgroups per SM, 528 per launch (kernel_mma.BLOCKS_PER_SM,
TARGET_GROUPS; 3 and 396); ``fuse`` = the tensor-core split kernel with the merge fused into it, one
launch (kernel_mma.FUSED_MERGE on); ``nofuse`` = the split kernel and the merge kernel, two launches (the default);
``binary`` = every precompiled kernel launched with its whole binary, not by reference (kernel_ref.BY_REFERENCE
off); ``unbound`` = no decode step bound, every step through the regular paths (decode_step.ENABLED off);
``noinplace`` = no code written in place (cache_append.INPLACE off: packed caches take the copy append or slice
updates, resident caches stage their codes, and neither binds its steps);
``slowsplit`` = the tensor-core split kernel's first setup and warp merge (a loop turn per load, a barrier per
butterfly stride of the queries' rotation, a barrier per warp; kernel_mma.QUICK_SPLIT off); ``slowmerge`` = the merge kernel's first version (kernel.QUICK_MERGE
off); ``slowboth`` = both; ``earlynorms`` = the tensor-core split kernel converting the next tile's norms right after their loads (kernel_mma.LATE_NORMS off); ``fullmax`` / ``quickmax`` = the tensor-core split kernel reducing its rows' maxima by shuffles at every tile (the default) / skipping them where no score passes the running maxima (kernel_mma.QUICK_MAX off / on); ``idx42`` / ``noidx42`` = 4+2 at head dim 128 building its table indices by bytes or one by one (kernel_mma.BYTE_INDEX_42); ``lds`` / ``lds1`` / ``nolds`` = the table reads by 32-bit shared address with 4+2's offsets built by byte permutes, by shared address alone, or through the generic pointer (kernel_mma.SHARED_ADDRESS 2 / 1 / 0); ``lds3`` = 2+2's too, its table at 256 bytes an entry in dynamic shared memory (SHARED_ADDRESS 3); ``pairs`` / ``oneturn`` = the tile loop taking two tiles a turn or one (kernel_mma.TILE_PAIRS); ``before`` = neither (the kernel of 2026-12-04); ``hostargs`` = the kernels' small constant inputs and the in-place append's count left where MLX puts host-made and 4-byte arrays (managed memory, the scalar pool; device_args.DEVICE_ARGS off); ``l2pfN`` = the tensor-core split kernel asking L2 for each warp's tile N turns ahead (kernel_mma.L2_PREFETCH, 0 = off); ``stagesN`` = the tensor-core split kernel copying each thread's words of a tile N - 1 turns ahead into a ring of N shared-memory slots by cp.async (kernel_mma.STAGES, 0 = off); ``a+b`` = both variants; ``fold`` / ``nofold`` = a bound packed step's append folded into the tensor-core split kernel or launched on its own (rvqstore.attention.fold.FOLD); ``sdpaNk`` = on CUDA, caches of fewer than N x 1024 tokens decline attention on the codes
(decode-then-SDPA on what update_and_fetch handed out; dispatch.MIN_TOKENS_ON_CODES_CUDA); ``sdpa`` = that at every
length (the other arm of the crossover); ``default`` = the modules' own settings. The SIMT layouts apply where the SIMT kernel serves: with
``simt`` for fp16 calls on CUDA."""

from __future__ import annotations

from rvqstore import cache_append, decode_step, device_args, host_malloc, kernel_ref
from rvqstore.attention import dispatch, fold, kernel, kernel_mma

VARIANTS = {"first": {"KEY_LANES": 1, "PAIR_TABLES": False, "STAGE_CODES": False, "VALUE_COORDS": 4},
            "nopair": {"PAIR_TABLES": False}, "nostage": {"STAGE_CODES": False}, "v4": {"VALUE_COORDS": 4},
            "v8": {"VALUE_COORDS": 8}, "simt": {"TENSOR_CORES": False}, "mma": {"TENSOR_CORES": True},
            "chunked": {"TENSOR_CORES": True, "STRIDED": False},
            "swap": {"TENSOR_CORES": True, "SWAPPED": True}, "noswap": {"TENSOR_CORES": True, "SWAPPED": False},
            "occ4": {"TENSOR_CORES": True, "BLOCKS_PER_SM": 4, "TARGET_GROUPS": 528},
            "fuse": {"FUSED_MERGE": True}, "nofuse": {"FUSED_MERGE": False},
            "binary": {"BY_REFERENCE": False}, "unbound": {"ENABLED": False}, "noinplace": {"INPLACE": False},
            "slowsplit": {"QUICK_SPLIT": False}, "slowmerge": {"QUICK_MERGE": False},
            "slowboth": {"QUICK_SPLIT": False, "QUICK_MERGE": False}, "earlynorms": {"LATE_NORMS": False},
            "fullmax": {"QUICK_MAX": False}, "quickmax": {"QUICK_MAX": True},
            "idx42": {"BYTE_INDEX_42": True}, "noidx42": {"BYTE_INDEX_42": False},
            "lds": {"SHARED_ADDRESS": 2}, "lds1": {"SHARED_ADDRESS": 1}, "nolds": {"SHARED_ADDRESS": 0},
            "lds3": {"SHARED_ADDRESS": 3},
            "pairs": {"TILE_PAIRS": True}, "oneturn": {"TILE_PAIRS": False},
            "before": {"SHARED_ADDRESS": 0, "TILE_PAIRS": False},
            "fold": {"FOLD": True}, "nofold": {"FOLD": False},
            "hostargs": {"DEVICE_ARGS": False}, "sdpa": {"MIN_TOKENS_ON_CODES_CUDA": 1 << 31}, "default": {}}
_MODULE = {"TENSOR_CORES": kernel_mma, "STRIDED": kernel_mma, "SWAPPED": kernel_mma, "BLOCKS_PER_SM": kernel_mma,
           "TARGET_GROUPS": kernel_mma, "FUSED_MERGE": kernel_mma, "QUICK_SPLIT": kernel_mma, "LATE_NORMS": kernel_mma, "QUICK_MAX": kernel_mma, "BYTE_INDEX_42": kernel_mma,
           "SHARED_ADDRESS": kernel_mma, "TILE_PAIRS": kernel_mma, "L2_PREFETCH": kernel_mma, "STAGES": kernel_mma,
           "BY_REFERENCE": kernel_ref, "ENABLED": decode_step, "INPLACE": cache_append,
           "DEVICE_ARGS": device_args, "MIN_TOKENS_ON_CODES_CUDA": dispatch, "FOLD": fold}  # settings that live outside kernel.py


def settings(name: str) -> dict:
    """The kernel module attributes variant ``name`` sets (``a+b``: both, ``b``'s settings last)."""
    if "+" in name:
        merged = {}
        for part in name.split("+"):
            merged.update(settings(part))
        return merged
    if name in VARIANTS:
        return VARIANTS[name]
    if name.startswith("kl") and name[2:].isdigit():
        return {"KEY_LANES": int(name[2:])}
    if name.startswith("stages") and name[6:].isdigit():
        return {"STAGES": int(name[6:])}
    if name.startswith("l2pf") and name[4:].isdigit():
        return {"L2_PREFETCH": int(name[4:])}
    if name.startswith("sdpa") and name.endswith("k") and name[4:-1].isdigit():
        return {"MIN_TOKENS_ON_CODES_CUDA": 1024 * int(name[4:-1])}
    raise SystemExit(f"unknown kernel variant {name!r}: one of {sorted(VARIANTS)}, klN, l2pfN, stagesN or sdpaNk")


def apply(name: str) -> dict:
    """Set variant ``name``; returns the previous values (for :func:`restore`)."""
    new = settings(name)
    if new.get("BY_REFERENCE") is False:  # binaries launched as rvqstore launches them without references
        host_malloc.tune()
    old = {k: getattr(_MODULE.get(k, kernel), k) for k in new}
    for k, v in new.items():
        setattr(_MODULE.get(k, kernel), k, v)
    return old


def restore(old: dict) -> None:
    for k, v in old.items():
        setattr(_MODULE.get(k, kernel), k, v)


def run(name: str, call):
    """``call()`` under variant ``name``, the module's settings restored after."""
    old = apply(name)
    try:
        return call()
    finally:
        restore(old)
