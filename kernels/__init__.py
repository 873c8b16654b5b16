"""Kernel sources for rvqstore's fused GPU paths (shipped as the subpackage ``rvqstore.kernels``).

One kernel body serves two dialects: ``mx.fast.metal_kernel`` (Apple GPUs) and
``mx.fast.cuda_kernel`` (MLX's CUDA backend). The files:

* ``rvq_prelude_metal.h`` / ``rvq_prelude_cuda.cuh``: the per-backend header prelude (types,
  qualifiers, barriers, shared memory, vector loads/stores).
* ``rvq_common.h``: the dialect-neutral device code (boundary counts, pack/unpack of one chunk).
* ``rvq_body_prelude_metal.inc`` / ``rvq_body_prelude_cuda.inc``: the first lines of every kernel
  body: thread indices. MLX scans a Metal body's *text* for thread-attribute names, so they are
  written out there, not hidden in a header macro.
* ``rvq_encode.inc`` / ``rvq_decode.inc``: the kernel bodies.
* ``rvq_attend.inc`` (with ``rvq_attend_body_prelude_*.inc``): split-K attention straight on the
  packed codes, and ``rvq_attend_merge.inc``, which merges its splits and un-rotates (both used by
  :mod:`rvqstore.attention.kernel`); ``rvq_attend_mma.inc`` (with ``rvq_mma_cuda.cuh``): the same split
  kernel on tensor cores, CUDA only (:mod:`rvqstore.attention.kernel_mma`).
* ``rvq_append.inc``: a cache step's new keys and values -> norms and packed codes in one launch
  (:mod:`rvqstore.cache_append`; CUDA), its encode of one vector in ``rvq_encode_row_cuda.cuh`` (shared with the
  split kernel that folds the append in, :mod:`rvqstore.attention.fold`); ``rvq_unpack.inc``: a packed cache's decoded keys and
  values in one launch (:mod:`rvqstore.cache_fetch`; CUDA).

:func:`load_source` reads one of them from the installed package.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

SOURCES = (
    "rvq_prelude_metal.h",
    "rvq_prelude_cuda.cuh",
    "rvq_common.h",
    "rvq_body_prelude_metal.inc",
    "rvq_body_prelude_cuda.inc",
    "rvq_encode.inc",
    "rvq_decode.inc",
    "rvq_attend_body_prelude_metal.inc",
    "rvq_attend_body_prelude_cuda.inc",
    "rvq_attend.inc",
    "rvq_attend_merge.inc",
    "rvq_mma_cuda.cuh",
    "rvq_attend_mma.inc",
    "rvq_encode_row_cuda.cuh",
    "rvq_append.inc",
    "rvq_unpack.inc",
    "rvq_upload.inc",
)


@lru_cache(maxsize=None)
def load_source(name: str) -> str:
    """The text of kernel source file ``name`` (one of :data:`SOURCES`)."""
    if name not in SOURCES:
        raise FileNotFoundError(f"no kernel source named {name!r} (have {', '.join(SOURCES)})")
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
