"""Dispatch to the fused GPU kernels: quantize+pack and unpack+dequantize in one pass each.

:meth:`RVQCodec.quantize` and :meth:`RVQCodec.dequantize` call :func:`quantize_pack` and
:func:`unpack_dequantize` when ``codec.use_kernels`` is set. Each returns the kernel's result, or
None to make the codec run its reference path (MLX ops), which is the definition of correct: the
kernels reproduce it bit for bit.

None is returned when there is no GPU backend (Metal: ``mx.metal.is_available()``, CUDA:
``mx.cuda.is_available()``) or the default device is not the GPU, when the input is not one the
kernels take (float32 ``y``, uint32 codes of the codec's word counts, non-empty), or when the
configuration's kernel was switched off. A kernel is switched off ("latched") per configuration
the first time it raises -- or, on its first use, when it disagrees with the reference on a probe
of boundary values -- and that is logged once through the ``rvqstore.kernels`` logger.

The kernel sources live in ``kernels/`` (installed as ``rvqstore.kernels``): one body per kernel,
shared by both dialects; see ``kernels/rvq_common.h`` for the work split. Planning (layouts, tables)
lives in :mod:`rvqstore.kernel_plan`, the first-use checks in :mod:`rvqstore.kernel_checks`; this
module detects the backend, builds and launches the kernels, latches and dispatches.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sys
import threading
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from . import kernel_cache, kernel_checks
from .kernel_checks import _reference_dequantize, _same, boundary_probe, boundary_values  # noqa: F401 (API)
from .kernel_plan import (  # noqa: F401 (re-exported: the plan names are part of this module's API)
    DECODE, DIALECTS, ENCODE, LAYOUT_CHUNK, LAYOUT_LANES, LINEAR_MAX_THRESHOLDS, MODE_CONDITIONAL, MODE_SHARED,
    MODE_SINGLE, SEARCH_BINARY, SEARCH_LINEAR, Plan, config_key, make_plan,
)

log = logging.getLogger("rvqstore.kernels")

#: threads per threadgroup (several vectors per threadgroup: 256 / (dim / chunk))
THREADS_PER_GROUP = 256
#: compare each configuration's kernel with the reference on a boundary probe before first use
SELF_CHECK = True

_MAX_THREADS = 2**31 - 1

_lock = threading.Lock()
_disabled: dict[tuple, str] = {}  # latched-off configurations -> why
_noted: set[tuple] = set()  # configurations whose unsupported reason was logged
_verified: set[tuple] = set()  # configurations that passed the first-use check
_kernels: dict[tuple, Callable] = {}
_plans: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


# ---- backend -------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def gpu_backend() -> str | None:
    """``"metal"``, ``"cuda"`` or None: the GPU backend of this MLX build, if it has a usable one."""
    try:
        if mx.metal.is_available():
            return "metal"
    except Exception:
        pass
    try:
        cuda = getattr(mx, "cuda", None)
        if cuda is not None and cuda.is_available():
            return "cuda"
    except Exception:
        pass
    return None


def _on_gpu() -> bool:
    try:
        return mx.default_device().type == mx.DeviceType.gpu
    except Exception:
        return False


# ---- sources -------------------------------------------------------------------------------------
def _kernels_module():
    """``rvqstore.kernels``: the installed subpackage, or ``<repo>/kernels`` in a source checkout."""
    try:
        from . import kernels  # installed: package-dir maps kernels/ to rvqstore.kernels

        return kernels
    except ImportError:
        pass
    name = __package__ + ".kernels"
    if name in sys.modules:
        return sys.modules[name]
    init = Path(__file__).resolve().parent.parent / "kernels" / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    if spec is None or spec.loader is None:
        raise ImportError(f"kernel sources not found (looked for {init})")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_source(name: str) -> str:
    return _kernels_module().load_source(name)


def kernel_sources(kind: str, dialect: str, two_stage: bool) -> tuple[str, str]:
    """``(header, body)`` exactly as handed to ``mx.fast.{metal,cuda}_kernel``."""
    if kind not in (ENCODE, DECODE) or dialect not in DIALECTS:
        raise ValueError(f"no kernel {kind!r} for dialect {dialect!r}")
    prelude = load_source("rvq_prelude_metal.h" if dialect == "metal" else "rvq_prelude_cuda.cuh")
    header = (f"{prelude}\n#define RVQ_CODES2 {'codes2' if two_stage else 'codes1'}\n"
              f"{load_source('rvq_common.h')}")
    body = load_source(f"rvq_body_prelude_{dialect}.inc") + load_source(f"rvq_{kind}.inc")
    return header, body


def _io_names(kind: str, two_stage: bool) -> tuple[list[str], list[str]]:
    if kind == ENCODE:
        return ["y", "tab", "params"], (["codes1", "codes2"] if two_stage else ["codes1"])
    return (["codes1", "codes2", "tab", "params"] if two_stage else ["codes1", "tab", "params"]), ["out"]


def _build_kernel(kind: str, dialect: str, two_stage: bool) -> Callable:
    header, body = kernel_sources(kind, dialect, two_stage)
    inputs, outputs = _io_names(kind, two_stage)
    # MLX's CUDA backend caches compiled kernels on disk by name: the name carries the source hash
    digest = hashlib.sha1((header + body).encode()).hexdigest()[:12]
    name = f"rvq_{kind}{2 if two_stage else 1}_{digest}"
    # CUDA: compiled once per machine and kept on disk (rvqstore.kernel_cache), MLX's JIT as the fallback
    make = mx.fast.metal_kernel if dialect == "metal" else kernel_cache.cuda_kernel
    return make(name=name, input_names=inputs, output_names=outputs, source=body, header=header,
                ensure_row_contiguous=True)


#: thread attributes MLX declares for a Metal kernel when their names occur in the body text
METAL_ATTRIBUTES = (
    "dispatch_quadgroups_per_threadgroup", "dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup", "grid_origin", "grid_size", "quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup", "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup",
    "thread_execution_width", "thread_index_in_quadgroup", "thread_index_in_simdgroup",
    "thread_index_in_threadgroup", "thread_position_in_grid", "thread_position_in_threadgroup",
    "threadgroup_position_in_grid", "threadgroups_per_grid", "threads_per_grid", "threads_per_simdgroup",
    "threads_per_threadgroup",
)


def cuda_translation_unit(kind: str, two_stage: bool, template: list[tuple[str, int]],
                          default_header: str, name: str = "rvq_kernel") -> str:
    """The CUDA source MLX's ``cuda_kernel`` hands NVRTC for this kernel (for offline compile checks).

    Mirrors MLX's wrapping (:func:`rvqstore.kernel_cache.translation_unit`): its default header, ours, then
    ``namespace mlx::core::cu`` with a ``__global__`` function taking ``const T* input..., T* output...``,
    the template arguments as ``constexpr int`` at the top of the body, then the body.
    """
    header, body = kernel_sources(kind, "cuda", two_stage)
    inputs, outputs = _io_names(kind, two_stage)
    in_types = {"y": "float", "tab": "float", "params": "uint32_t", "codes1": "uint32_t", "codes2": "uint32_t"}
    out_types = {"codes1": "uint32_t", "codes2": "uint32_t", "out": "float"}
    return kernel_cache.translation_unit(name, header, body, [(n, in_types[n]) for n in inputs],
                                         [(n, out_types[n]) for n in outputs], template,
                                         default_header=default_header, extern_c=False)


def _kernel(kind: str, dialect: str, two_stage: bool) -> Callable:
    key = (kind, dialect, two_stage)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = _build_kernel(kind, dialect, two_stage)
    return k


def _plan(codec, kind: str, stage1_only: bool) -> Plan | str:
    per = _plans.setdefault(codec, {})
    key = (kind, stage1_only)
    p = per.get(key)
    if p is None:
        p = per[key] = make_plan(codec, kind, stage1_only)
    return p


# ---- launches (no fallback: these raise) ----------------------------------------------------------
_params_cache: dict[tuple, mx.array] = {}


def _params(plan: Plan, n: int, layout: int | None) -> tuple[mx.array, int]:
    tpv = plan.threads_per_vector(layout)
    threads = n * tpv
    if threads > _MAX_THREADS:
        raise ValueError(f"{n} vectors need {threads} threads, more than one launch takes")
    key = (threads, plan.dim, tpv, plan.words1, plan.words2)
    p = _params_cache.get(key)
    if p is None:  # small host array; keep the recent ones instead of rebuilding per call
        if len(_params_cache) > 256:
            _params_cache.clear()
        p = _params_cache[key] = mx.array(list(key), dtype=mx.uint32)
    return p, threads


def launch_encode(plan: Plan, y2d: mx.array, dialect: str, *, search: int | None = None,
                  layout: int | None = None, threads_per_group: int | None = None
                  ) -> tuple[mx.array, mx.array | None]:
    """Run the encode kernel on ``y2d`` (float32, ``(N, dim)``): packed ``(codes1, codes2)``."""
    n = int(y2d.shape[0])
    if layout == LAYOUT_LANES and not plan.lanes_ok:
        raise ValueError("this configuration has no lanes layout")
    params, threads = _params(plan, n, layout)
    two = plan.bits2 > 0
    shapes = [(n, plan.words1)] + ([(n, plan.words2)] if two else [])
    out = _kernel(ENCODE, dialect, two)(
        inputs=[y2d, plan.tab, params], template=plan.template(search, layout),
        grid=(threads, 1, 1), threadgroup=(threads_per_group or THREADS_PER_GROUP, 1, 1),
        output_shapes=shapes, output_dtypes=[mx.uint32] * len(shapes))
    return out[0], (out[1] if two else None)


def launch_decode(plan: Plan, codes1: mx.array, codes2: mx.array | None, dialect: str, *,
                  layout: int | None = None, threads_per_group: int | None = None) -> mx.array:
    """Run the decode kernel: ``y_hat`` (float32, ``(N, dim)``) from ``(N, words)`` codes."""
    n = int(codes1.shape[0])
    if layout == LAYOUT_LANES and not plan.lanes_ok:
        raise ValueError("this configuration has no lanes layout")
    params, threads = _params(plan, n, layout)
    two = plan.bits2 > 0
    inputs = [codes1] + ([codes2] if two else []) + [plan.tab, params]
    return _kernel(DECODE, dialect, two)(
        inputs=inputs, template=plan.template(layout=layout),
        grid=(threads, 1, 1), threadgroup=(threads_per_group or THREADS_PER_GROUP, 1, 1),
        output_shapes=[(n, plan.dim)], output_dtypes=[mx.float32])[0]


# ---- latch -----------------------------------------------------------------------------------------
def disabled() -> dict[tuple, str]:
    """The configurations whose kernel is latched off, and why."""
    with _lock:
        return dict(_disabled)


def reset() -> None:
    """Forget latches, first-use checks and built kernels (tests, or after fixing a backend)."""
    with _lock:
        _disabled.clear()
        _noted.clear()
        _verified.clear()
        _kernels.clear()


def _latch(key: tuple, dialect: str, err: BaseException) -> None:
    with _lock:
        first = key not in _disabled
        _disabled[key] = f"{type(err).__name__}: {err}"
    if first:
        log.warning("fused %s kernel (%s) switched off for dim=%d bits=(%d, %d) residual=%s; using the "
                    "reference path: %s: %s", key[0], dialect, key[1], key[2], key[3], key[4],
                    type(err).__name__, err)


def _note(key: tuple, reason: str) -> None:
    with _lock:
        first = (key, reason) not in _noted
        _noted.add((key, reason))
    if first:
        log.info("fused %s kernel does not take dim=%d bits=(%d, %d) residual=%s (%s); using the "
                 "reference path", key[0], key[1], key[2], key[3], key[4], reason)


def _run(codec, key: tuple, dialect: str, launch: Callable[[], Any], check: Callable[[], None]):
    try:
        first = key not in _verified
        if first:
            kernel_cache.begin_launch_log()
        out = launch()
        if first:
            # first use of this configuration: build and run it now (errors surface here, not in a
            # later mx.eval the caller cannot recover from), then compare with the reference -- unless
            # this machine checked these very binaries before (rvqstore.kernel_cache keeps the verdict)
            vkey = kernel_cache.verdict_key("fused", key, kernel_cache.launched_binaries()) if SELF_CHECK else None
            kept = kernel_cache.verdict(vkey)
            if isinstance(kept, str):
                raise RuntimeError(f"failed its first-use check on this machine before: {kept}")
            mx.eval(out)
            if SELF_CHECK and kept is not True:
                try:
                    check()
                except kernel_checks.CheckFailed as err:  # a disagreement (not an error on the way) is kept
                    kernel_cache.record_verdict(vkey, False, str(err))
                    raise
                kernel_cache.record_verdict(vkey, True)
            with _lock:
                _verified.add(key)
        return out
    except Exception as err:  # any failure: fall back, latch off, say so once
        _latch(key, dialect, err)
        return None


# ---- the codec's hooks -------------------------------------------------------------------------------
def quantize_pack(codec, y: mx.array) -> tuple[mx.array, mx.array | None] | None:
    """Fused quantize + pack of rotated coordinates ``y`` ``(..., dim)``, or None (use the reference)."""
    dialect = gpu_backend()
    if dialect is None or not _on_gpu():
        return None
    key = config_key(codec, ENCODE)
    if key in _disabled:
        return None
    if not isinstance(y, mx.array) or y.dtype != mx.float32 or y.ndim == 0 or y.shape[-1] != codec.dim \
            or y.size == 0:
        return None
    plan = _plan(codec, ENCODE, False)
    if isinstance(plan, str):
        _note(key, plan)
        return None
    lead = tuple(y.shape[:-1])
    y2d = y.reshape(-1, codec.dim)
    out = _run(codec, key, dialect, lambda: launch_encode(plan, y2d, dialect),
               lambda: kernel_checks.check_encode(codec, plan, dialect, launch_encode))
    if out is None:
        return None
    c1, c2 = out
    return c1.reshape(*lead, plan.words1), (c2.reshape(*lead, plan.words2) if c2 is not None else None)


def unpack_dequantize(codec, codes1: mx.array, codes2: mx.array | None) -> mx.array | None:
    """Fused unpack + dequantize to rotated coordinates ``y_hat`` (float32), or None (use the reference).

    ``codes2`` None (or a single-stage codec): stage 1 only.
    """
    dialect = gpu_backend()
    if dialect is None or not _on_gpu():
        return None
    stage1_only = codes2 is None or not codec.bits2
    key = config_key(codec, DECODE, stage1_only)
    if key in _disabled:
        return None
    if not isinstance(codes1, mx.array) or codes1.dtype != mx.uint32 or codes1.ndim == 0 \
            or codes1.shape[-1] != codec.words1 or codes1.size == 0:
        return None
    if not stage1_only and (not isinstance(codes2, mx.array) or codes2.dtype != mx.uint32
                            or tuple(codes2.shape) != tuple(codes1.shape[:-1]) + (codec.words2,)):
        return None
    plan = _plan(codec, DECODE, stage1_only)
    if isinstance(plan, str):
        _note(key, plan)
        return None
    lead = tuple(codes1.shape[:-1])
    c1 = codes1.reshape(-1, codec.words1)
    c2 = None if stage1_only else codes2.reshape(-1, codec.words2)
    out = _run(codec, key, dialect, lambda: launch_decode(plan, c1, c2, dialect),
               lambda: kernel_checks.check_decode(codec, plan, dialect, launch_decode))
    if out is None:
        return None
    return out.reshape(*lead, codec.dim)
