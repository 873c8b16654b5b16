"""A cross-process cache of rvqstore's CUDA kernels: NVRTC once per machine, the cubin kept on disk.

MLX 0.32's CUDA backend compiles every ``mx.fast.cuda_kernel`` with NVRTC in every process (its disk
cache of compiled modules is written for its own kernels only), which made a fresh process's first cache
update and attention cost seconds. :func:`cuda_kernel` takes the same arguments as
``mx.fast.cuda_kernel`` and returns a kernel that, per configuration (template arguments and dtypes):

1. writes the whole translation unit itself (as MLX wraps a body: a ``__global__`` function taking
   ``const T* input..., T* output...``, the template arguments as ``constexpr`` at the top of the body),
   with a small header of its own instead of MLX's embedded device headers (the bodies need only the
   CUDA half/bfloat16 types);
2. looks for its compiled code in the cache directory (:func:`cache_dir`; a file named by the SHA-256 of
   the source, NVRTC options, architecture and NVRTC version; checksummed, written atomically; a
   corrupt or foreign file is ignored and rebuilt), else compiles it with NVRTC through ctypes (the
   library MLX itself loaded) and stores it;
3. launches it with ``mx.fast.precompiled_cuda_kernel`` (inputs, then outputs, as pointers; our kernels
   take their sizes through a params array, so no shapes or scalars are passed), by a short reference
   to the binary once a first launch so showed MLX finds it (:mod:`rvqstore.kernel_ref`: MLX copies
   and hashes what it is handed on every launch).

Anything failing on that way (no NVRTC, no CUDA headers, a compile error, a module that does not load)
switches that configuration over to ``mx.fast.cuda_kernel`` with the same source, silently apart from
one log line: the result is the same kernel either way (bit-identical outputs:
``tests/test_kernel_cache_gpu.py``). Metal and CPU never come here.

It also keeps the verdicts of the kernels' first-use checks per machine (:func:`verdict`,
:func:`record_verdict`), so a later process skips the checks (which build the reference paths too). A
check that failed stays failed.

``RVQSTORE_KERNEL_CACHE``: the cache directory (default ``~/.cache/rvqstore/kernels``; a subdirectory
per MLX version); ``off`` (or ``0``) turns the cache off: kernels then go through ``mx.fast.cuda_kernel``
and no verdict is kept.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import host_malloc, kernel_ref, user_cache

log = logging.getLogger("rvqstore.kernels")

ENV = "RVQSTORE_KERNEL_CACHE"
#: bumped when the file layout or the translation unit's wrapping changes (old files are then not found)
FORMAT = 1
_MAGIC = b"RVQKERN1"
#: a cached binary larger than this is not a kernel of ours: ignored, not read
MAX_BINARY_BYTES = 64 << 20
#: what our translation units include instead of MLX's device headers (mlx/backend/cuda/device/utils.cuh)
DEFAULT_HEADER = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;

"""
#: C++ types of MLX dtypes, as MLX's dtype_to_cuda_type spells them
CUDA_TYPES = {
    "bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
    "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
}

_lock = threading.Lock()
#: what this process did: kernels compiled with NVRTC, loaded from the cache's files, sent to MLX's JIT;
#: first-use checks skipped thanks to a kept verdict; configurations launched by reference
#: (tools/bench_cold_start.py prints them)
stats = {"compiled": 0, "loaded": 0, "jit_launches": 0, "verdicts_kept": 0, "by_reference": 0}


def dtype_name(dtype) -> str:
    """``"float32"`` for ``mx.float32`` (MLX prints dtypes as ``mlx.core.float32``)."""
    return str(dtype).rsplit(".", 1)[-1]


def cuda_type(dtype) -> str:
    name = dtype_name(dtype)
    if name not in CUDA_TYPES:
        raise TypeError(f"no CUDA type for {dtype}")
    return CUDA_TYPES[name]


# ---- the translation unit ----------------------------------------------------------------------------
def translation_unit(func_name: str, header: str, body: str, inputs: list[tuple[str, str]],
                     outputs: list[tuple[str, str]], template: list[tuple[str, Any]],
                     default_header: str = DEFAULT_HEADER, extern_c: bool = True, launch_bounds: str = "") -> str:
    """The CUDA source of one kernel, wrapped as MLX's ``cuda_kernel`` wraps a body.

    ``inputs`` / ``outputs``: ``(name, C++ type)`` in argument order; ``template``: ``(name, value)`` with
    int, bool or an MLX dtype values (``constexpr int`` / ``constexpr bool`` / ``using``). ``extern_c``
    gives the function C linkage (its symbol is then ``func_name``, which the precompiled launch names).
    ``launch_bounds``: e.g. ``"128, 3"`` (threads per block, blocks per SM): a register budget MLX's own
    wrapping cannot give (its JIT fallback runs without it).
    """
    args = [f"    const {t}* {n}" for n, t in inputs] + [f"    {t}* {n}" for n, t in outputs]
    consts = []
    for name, value in template:
        if isinstance(value, bool):
            consts.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, int):
            consts.append(f"  constexpr int {name} = {value};\n")
        else:
            consts.append(f"  using {name} = {cuda_type(value)};\n")
    link = 'extern "C" ' if extern_c else ""
    return (f"{default_header}\n{header}namespace mlx::core::cu {{\n\n"
            f"{link}__global__ void {f'__launch_bounds__({launch_bounds}) ' if launch_bounds else ''}{func_name}(\n" + ",\n".join(args) + ") {\n" + "".join(consts)
            + ("\n" if consts else "") + body + "\n}\n\n} // namespace mlx::core::cu\n")


# ---- where things live ---------------------------------------------------------------------------------
def cache_dir() -> Path | None:
    """The directory of this MLX version's cached kernels and verdicts, or None (cache turned off)."""
    root = user_cache.directory(ENV, "kernels")
    return None if root is None else root / mx.__version__


def _pack(key: str, name: str, binary: bytes) -> bytes:
    head = json.dumps({"key": key, "name": name, "size": len(binary),
                       "sha256": hashlib.sha256(binary).hexdigest()}).encode()
    return _MAGIC + len(head).to_bytes(4, "little") + head + binary


def _unpack(key: str, data: bytes) -> tuple[str, bytes] | None:
    """``(name, binary)`` from a cache file's bytes, or None for anything that is not ours for ``key``."""
    try:
        if not data.startswith(_MAGIC):
            return None
        n = int.from_bytes(data[len(_MAGIC):len(_MAGIC) + 4], "little")
        start = len(_MAGIC) + 4
        if n > 4096 or start + n > len(data):
            return None
        head = json.loads(data[start:start + n])
        binary = data[start + n:]
        if (not isinstance(head, dict) or head.get("key") != key or head.get("size") != len(binary)
                or head.get("sha256") != hashlib.sha256(binary).hexdigest()
                or not isinstance(head.get("name"), str) or not re.fullmatch(r"[A-Za-z_]\w{0,200}", head["name"])):
            return None
        return head["name"], binary
    except (ValueError, UnicodeDecodeError):
        return None


def read_binary(key: str) -> tuple[str, bytes] | None:
    d = cache_dir()
    if d is None:
        return None
    path = d / f"{key}.bin"
    try:
        if path.stat().st_size > MAX_BINARY_BYTES:
            return None
        return _unpack(key, path.read_bytes())
    except OSError:
        return None


def write_binary(key: str, name: str, binary: bytes) -> None:
    d = cache_dir()
    if d is None:
        return
    try:
        user_cache.atomic_write(d / f"{key}.bin", _pack(key, name, binary))
    except OSError as err:  # a read-only or full disk: the kernel still runs, it is only not kept
        log.info("kernel cache: could not write %s: %s", d, err)


# ---- NVRTC through ctypes ------------------------------------------------------------------------------
class NvrtcError(RuntimeError):
    pass


def _loaded_library(stem: str) -> str | None:
    """The path of a shared library already mapped into this process (MLX's CUDA backend links NVRTC)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                base = os.path.basename(path)
                if base.startswith(stem + ".so") and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


def _site_dirs() -> list[Path]:
    dirs = [Path(mx.__file__).resolve().parent.parent] if getattr(mx, "__file__", None) else []
    dirs += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    out = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


@lru_cache(maxsize=1)
def nvrtc_library() -> tuple[ctypes.CDLL, str]:
    """NVRTC and its path: the one MLX loaded, else an nvidia-* wheel's, else the CUDA toolkit's."""
    candidates = [_loaded_library("libnvrtc")]
    for d in _site_dirs():
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            candidates += sorted(str(p) for p in (d / sub).glob("libnvrtc.so*") if "builtins" not in p.name)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates += sorted(str(p) for p in Path(home, "lib64").glob("libnvrtc.so*"))
    candidates += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    errors = []
    for c in candidates:
        if not c:
            continue
        try:
            lib = ctypes.CDLL(c)
            lib.nvrtcVersion  # noqa: B018 (raises AttributeError if this is not NVRTC)
            return lib, c
        except (OSError, AttributeError) as err:
            errors.append(f"{c}: {err}")
    raise NvrtcError("NVRTC not found (" + "; ".join(errors[-3:]) + ")")


def nvrtc_version() -> tuple[int, int]:
    lib, _ = nvrtc_library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(lib, status: int, what: str) -> None:
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise NvrtcError(f"{what} failed: {lib.nvrtcGetErrorString(status).decode(errors='replace')}")


@lru_cache(maxsize=1)
def include_dirs() -> tuple[str, ...]:
    """The CUDA headers, found as MLX finds them: next to the NVRTC in use (the nvidia wheel's tree),
    site-packages' ``nvidia/cu13`` (``cuda_runtime`` for CUDA 12), ``CUDA_HOME``/``CUDA_PATH``, /usr/local/cuda."""
    found = []
    try:
        _, path = nvrtc_library()
        if os.path.isabs(path):
            found.append(Path(path).resolve().parent.parent / "include")
    except NvrtcError:
        pass
    for d in _site_dirs():
        found += [d / "nvidia" / "cu13" / "include", d / "nvidia" / "cuda_runtime" / "include"]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found.append(Path(home) / "include")
    for p in found:
        if (p / "cuda_fp16.h").is_file():
            return (str(p),)
    raise NvrtcError("CUDA headers (cuda_fp16.h) not found; set CUDA_HOME")


def supports_sass(nvrtc: tuple[int, int], cc: tuple[int, int]) -> bool:
    """Whether this NVRTC compiles to the device's SASS (cubin), MLX's rule; else PTX for the driver."""
    major, minor = nvrtc
    if major < 9:
        return False
    if major == 9:
        return cc <= (7, 2)
    if major == 10:
        return cc <= (7, 5)
    if major == 11 and minor == 0:
        return cc <= (8, 0)
    if major == 11 and minor < 8:
        return cc <= (8, 6)
    return True


def arch_option(cc: tuple[int, int], sass: bool) -> str:
    """MLX's ``--gpu-architecture``: ``sm_90a`` on an H100/H200 (arch-specific features from 9.0 on)."""
    return f"--gpu-architecture={'sm' if sass else 'compute'}_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}"


def compile_source(source: str, options: list[str], program_name: str = "rvq_kernel.cu") -> tuple[bytes, str]:
    """Compile CUDA ``source`` with NVRTC: ``(binary, log)``; cubin when an ``sm_`` architecture is given,
    else PTX. Raises :class:`NvrtcError` (with the compiler's log) on failure."""
    lib, _ = nvrtc_library()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), program_name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buf = ctypes.create_string_buffer(size.value + 1)
        _check(lib, lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        text = buf.value.decode(errors="replace")
        if status != 0:
            raise NvrtcError(f"NVRTC could not compile the kernel: {text[-2000:]}")
        cubin = any(o.startswith("--gpu-architecture=sm_") for o in options)
        get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin
                         else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
        _check(lib, get_size(prog, ctypes.byref(size)), "nvrtcGet*Size")
        out = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, out), "nvrtcGet*")
        return out.raw, text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# ---- the device ----------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def device() -> dict:
    """``{"name", "cc"}`` of the default CUDA device (from ``mx.device_info()``)."""
    info = mx.device_info()
    cc = (int(info["compute_capability_major"]), int(info["compute_capability_minor"]))
    return {"name": str(info.get("device_name", "cuda")), "cc": cc}


@lru_cache(maxsize=1)
def compile_setup() -> tuple[list[str], str]:
    """NVRTC options for this device and the part of the cache key they and the compiler make."""
    cc = device()["cc"]
    ver = nvrtc_version()
    options = ["--device-as-default-execution-space", arch_option(cc, supports_sass(ver, cc))]
    options += [f"--include-path={d}" for d in include_dirs()]
    # the key names what changes the binary: options but for the include paths' location, and NVRTC
    ident = " ".join(o for o in options if not o.startswith("--include-path")) + f" nvrtc {ver[0]}.{ver[1]}"
    return options, ident


def binary_key(source: str, ident: str) -> str:
    return hashlib.sha256(f"rvqstore kernel v{FORMAT}\n{ident}\n{source}".encode()).hexdigest()


def get_binary(source: str, func_name: str) -> tuple[str, bytes, str]:
    """``(symbol, binary, key)`` of ``source``'s kernel: the cache's file, or NVRTC now (then stored)."""
    options, ident = compile_setup()
    key = binary_key(source, ident)
    got = read_binary(key)
    if got is not None:
        stats["loaded"] += 1
        return got[0], got[1], key
    binary, _ = compile_source(source, options, f"{func_name}.cu")
    stats["compiled"] += 1
    write_binary(key, func_name, binary)
    return func_name, binary, key


_launched = threading.local()


def begin_launch_log() -> None:
    """Start noting which cached binaries this thread launches (:func:`launched_binaries`)."""
    _launched.keys = []


def launched_binaries() -> tuple[str, ...]:
    """The keys of the cached binaries launched since :func:`begin_launch_log` (in order, no repeats); ends
    the log (a decode loop's launches are not noted)."""
    keys = getattr(_launched, "keys", None) or []
    _launched.keys = None
    return tuple(dict.fromkeys(keys))


# ---- the kernel ----------------------------------------------------------------------------------------
_TRACING = "function transformations"  # MLX's message for an eval inside mx.compile / vmap


class CudaKernel:
    """``mx.fast.cuda_kernel``'s callable, launched from the disk cache (see the module's docstring)."""

    def __init__(self, name: str, input_names: list[str], output_names: list[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, launch_bounds: str = ""):
        self.name = name
        self.launch_bounds = launch_bounds
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self._jit: dict = {}  # dynamic shared memory bytes -> MLX's JIT kernel (mx.fast.cuda_kernel fixes it)
        # (template, dtypes) -> (symbol, binary, key, what a launch passes: the binary or its reference), or
        # None (use the JIT kernel)
        self._entries: dict = {}
        self._checked: set = set()  # configurations whose precompiled launch evaluated once
        # MLX passes shapes/strides to a body that names them; a precompiled launch passes none
        self._needs_shapes = any(re.search(rf"\b{re.escape(n)}_(shape|strides|ndim)\b", source)
                                 for n in self.input_names)
        self.digest = hashlib.sha256((header + "\0" + source + "\0" + launch_bounds).encode()).hexdigest()[:16]

    def jit(self, shared_memory: int = 0):
        k = self._jit.get(shared_memory)
        if k is None:
            k = self._jit[shared_memory] = mx.fast.cuda_kernel(
                name=self.name, input_names=self.input_names, output_names=self.output_names, source=self.source,
                header=self.header, ensure_row_contiguous=self.ensure_row_contiguous, shared_memory=shared_memory)
        return k

    def source_for(self, template: list, in_dtypes: tuple, out_dtypes: tuple) -> tuple[str, str]:
        """``(symbol, translation unit)`` of one configuration."""
        sig = hashlib.sha256(repr((self.digest, [(n, dtype_name(v) if isinstance(v, mx.Dtype) else v)
                                                  for n, v in template], [dtype_name(d) for d in in_dtypes],
                                   [dtype_name(d) for d in out_dtypes])).encode()).hexdigest()[:16]
        func = f"rvq_{re.sub(r'[^A-Za-z0-9_]', '_', self.name)[:48]}_{sig}"
        tu = translation_unit(func, self.header, self.source,
                              [(n, cuda_type(d)) for n, d in zip(self.input_names, in_dtypes)],
                              [(n, cuda_type(d)) for n, d in zip(self.output_names, out_dtypes)], template,
                              launch_bounds=self.launch_bounds)
        return func, tu

    def _entry(self, key, template, in_dtypes, out_dtypes):
        entry = self._entries.get(key, _MISSING)
        if entry is _MISSING:
            entry = None
            if not self._needs_shapes and cache_dir() is not None:
                try:
                    func, tu = self.source_for(template, in_dtypes, out_dtypes)
                    entry = get_binary(tu, func)
                    entry = entry + (entry[1],)
                except Exception as err:  # no NVRTC, headers, a compile error: MLX's JIT path instead
                    log.info("kernel cache: %s compiled by MLX instead (%s: %s)", self.name, type(err).__name__,
                             str(err)[:300])
            with _lock:
                self._entries[key] = entry
        return entry

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None, shared_memory=0):
        """As ``mx.fast.cuda_kernel``'s callable; ``shared_memory``: the launch's dynamic shared memory in bytes
        (for a body that declares ``extern __shared__``; MLX raises the kernel's limit above 48,000)."""
        template = template or []
        in_dtypes = tuple([a.dtype for a in inputs])
        out_dtypes = tuple(output_dtypes)
        key = (tuple(template), in_dtypes, out_dtypes)
        entry = self._entry(key, template, in_dtypes, out_dtypes)
        if entry is not None:
            out = None

            def launch(source):
                return mx.fast.precompiled_cuda_kernel(
                    name=entry[0], compiled_source=source, inputs=inputs, output_shapes=output_shapes,
                    output_dtypes=output_dtypes, scalars=[], grid=grid, threadgroup=threadgroup,
                    shared_memory=shared_memory, init_value=init_value,
                    ensure_row_contiguous=self.ensure_row_contiguous, stream=stream)
            try:
                if key in self._checked:
                    out = launch(_source(entry))
                else:  # the module loads at evaluation: make that happen here once
                    out = self._first_launch(key, entry, launch)
                log_ = getattr(_launched, "keys", None)
                if log_ is not None:
                    log_.append(entry[2])
                return out
            except Exception as err:
                if out is not None and _TRACING in str(err):  # inside mx.compile: evaluated later, by the caller
                    return out
                log.warning("kernel cache: precompiled %s failed (%s: %s); MLX compiles it instead",
                            self.name, type(err).__name__, _brief(str(err)))
                with _lock:
                    self._entries[key] = None
        stats["jit_launches"] += 1
        return self.jit(shared_memory)(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                                       grid=grid, threadgroup=threadgroup, template=template, init_value=init_value,
                                       verbose=verbose, stream=stream)

    def _first_launch(self, key, entry, launch):
        """Launch and evaluate a configuration's first call: by reference (:mod:`rvqstore.kernel_ref`) where
        MLX's module cache takes it, else with the binary; the entry then names what later launches pass.
        Inside ``mx.compile`` nothing can be evaluated: the binary's launch goes back unchecked."""
        ref = kernel_ref.publish(entry[0], entry[1])
        failed = None
        if ref is not None:
            try:
                out = launch(ref)
                mx.eval(out)
            except Exception as err:
                if _TRACING in str(err):
                    return launch(entry[1])
                failed = f"{self.name}: {type(err).__name__}: {_brief(str(err))}"
            else:
                with _lock:
                    self._entries[key] = entry[:3] + (ref,)
                    self._checked.add(key)
                stats["by_reference"] += 1
                return out
        out = launch(entry[1])
        try:
            mx.eval(out)
        except Exception as err:
            if _TRACING in str(err):
                return out
            raise
        if failed:  # the binary loads where its reference did not: MLX does not find modules as we expect
            kernel_ref.give_up(failed)
        host_malloc.tune()  # later launches copy the binary into their nodes: keep those pages mapped
        self._checked.add(key)
        return out

    def precompiled(self) -> int:
        """How many configurations launch from cached binaries (the rest go through MLX's JIT)."""
        return sum(e is not None for e in self._entries.values())

    def prepare(self, template: list, in_dtypes: tuple, out_dtypes: list, shared_memory: int = 0) -> "PreparedLaunch":
        """This kernel with its template, dtypes and dynamic shared memory fixed (:class:`PreparedLaunch`)."""
        return PreparedLaunch(self, template, in_dtypes, out_dtypes, shared_memory)


class PreparedLaunch:
    """One configuration of a :class:`CudaKernel` (template, input and output dtypes fixed), for a caller
    that launches it every decode step: once its precompiled launch has run (through
    :meth:`CudaKernel.__call__`, which loads and checks it), a call goes straight to MLX's
    ``precompiled_cuda_kernel``, without the template and dtype keys ``__call__`` builds and looks up
    per call (~4 us of host time per launch). The caller passes inputs of exactly ``in_dtypes``."""

    __slots__ = ("kernel", "template", "out_dtypes", "key", "shared_memory", "_entry")

    def __init__(self, kernel: CudaKernel, template: list, in_dtypes: tuple, out_dtypes: list, shared_memory: int = 0):
        self.kernel = kernel
        self.shared_memory = shared_memory
        self.template = list(template)
        self.out_dtypes = list(out_dtypes)
        self.key = (tuple(self.template), tuple(in_dtypes), tuple(self.out_dtypes))
        self._entry = None  # the precompiled entry, once a launch through the kernel ran it

    def __call__(self, inputs: list, output_shapes: list, grid: tuple, threadgroup: tuple) -> list:
        entry = self._entry
        if entry is not None:
            try:
                out = mx.fast.precompiled_cuda_kernel(
                    name=entry[0], compiled_source=_source(entry), inputs=inputs, output_shapes=output_shapes,
                    output_dtypes=self.out_dtypes, scalars=[], grid=grid, threadgroup=threadgroup,
                    shared_memory=self.shared_memory, init_value=None,
                    ensure_row_contiguous=self.kernel.ensure_row_contiguous, stream=None)
            except Exception:  # the kernel's own path decides (MLX's JIT instead, logged)
                self._entry = None
            else:
                log_ = getattr(_launched, "keys", None)
                if log_ is not None:
                    log_.append(entry[2])
                return out
        out = self.kernel(inputs=inputs, template=self.template, output_shapes=output_shapes,
                          output_dtypes=self.out_dtypes, grid=grid, threadgroup=threadgroup,
                          shared_memory=self.shared_memory)
        if self.key in self.kernel._checked:  # its precompiled launch ran: from now on, directly
            self._entry = self.kernel._entries.get(self.key)
        return out


_MISSING = object()


def _source(entry) -> bytes | str:
    """What a launch of a checked entry passes as its code: the reference, unless switched to binaries."""
    return entry[3] if kernel_ref.BY_REFERENCE else entry[1]


def _brief(msg: str, head: int = 200, tail: int = 400) -> str:
    """A long error message's start and end (nanobind's argument errors name the types passed at the end)."""
    return msg if len(msg) <= head + tail else f"{msg[:head]} ... {msg[-tail:]}"


def cuda_kernel(name: str, input_names: list[str], output_names: list[str], source: str, header: str = "",
                ensure_row_contiguous: bool = True, launch_bounds: str = "") -> CudaKernel:
    """A drop-in for ``mx.fast.cuda_kernel`` whose compiled code is cached across processes (``launch_bounds``:
    see :func:`translation_unit`)."""
    return CudaKernel(name, input_names, output_names, source, header, ensure_row_contiguous, launch_bounds)


# ---- first-use verdicts, per machine ---------------------------------------------------------------------
def verdict_key(what: str, config: Any, binaries: tuple[str, ...]) -> str | None:
    """The key of one first-use check on this machine: the check, its configuration, the cached binaries
    it launched (their keys name source, options, architecture and NVRTC), the device, MLX and rvqstore's
    code; None where no verdict is kept (cache off, no cached binary launched, no CUDA device)."""
    if cache_dir() is None or not binaries:
        return None
    try:
        dev = device()
    except Exception:
        return None
    text = repr((FORMAT, what, config, binaries, dev["name"], dev["cc"], mx.__version__, code_digest()))
    return hashlib.sha256(text.encode()).hexdigest()


@lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of rvqstore's Python code and kernel sources: a verdict holds for the code that made it."""
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parent
    # the kernel sources: installed as rvqstore/kernels, or <checkout>/kernels
    roots = [pkg] + [p for p in (pkg / "kernels", pkg.parent / "kernels") if (p / "rvq_common.h").is_file()][:1]
    for root in roots:
        for f in sorted(root.rglob("*")):
            if f.suffix in (".py", ".inc", ".h", ".cuh") and "__pycache__" not in f.parts:
                try:
                    h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
                except OSError:
                    pass
    return h.hexdigest()


def verdict(key: str | None) -> bool | str | None:
    """True (passed), the reason it failed (str), or None (not checked on this machine yet)."""
    v = _read_verdict(key)
    if v is not None:
        stats["verdicts_kept"] += 1
    return v


def _read_verdict(key: str | None) -> bool | str | None:
    d = cache_dir()
    if key is None or d is None:
        return None
    v = user_cache.read_record(d / f"{key}.verdict", key)
    if v is None or not isinstance(v.get("ok"), bool):
        return None
    return True if v["ok"] else str(v.get("why", "failed"))[:500]


def record_verdict(key: str | None, ok: bool, why: str = "") -> None:
    """Keep a check's verdict; a failure already kept is never overwritten (a failed check stays failed)."""
    d = cache_dir()
    if key is None or d is None or isinstance(_read_verdict(key), str):
        return
    try:
        user_cache.write_record(d / f"{key}.verdict", key, {"ok": bool(ok), "why": why[:500]})
    except OSError as err:
        log.info("kernel cache: could not write a verdict in %s: %s", d, err)
