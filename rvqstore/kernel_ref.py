"""Launch a cached CUDA kernel by a short reference instead of passing its whole binary every time.

MLX 0.32's ``mx.fast.precompiled_cuda_kernel(name, compiled_source, ...)`` copies ``compiled_source`` into
every graph node it builds and, at every evaluation, names the module it needs by hashing it
(``fmt::format("{}_{:x}", name, std::hash<std::string>{}(source))`` in ``mlx/backend/cuda/custom_kernel.cpp``).
For our 12-32 KB binaries that is ~0.3 us of hashing per KB per launch, plus the copies: a decode step
launches ~60 KB of binaries per layer (``tools/results/launch-overhead-h200*.json``).

MLX looks a module up by that name in memory, then in its on-disk module cache
(``$MLX_PTX_CACHE_DIR``, default ``<temp>/mlx/<version>/ptx``: ``<module>.ptx`` holding the code and
``<module>.txt`` one ``name<TAB>symbol`` line per kernel), and only then loads ``compiled_source`` itself.
So :func:`publish` writes a kernel's binary into that cache under the module name of a short reference
string (``b"rvqstore-kernel:<sha256 of the binary>"``) and hands the reference back: a launch passing the
reference loads the same code, and each node copies and hashes ~90 bytes.

This leans on how MLX names and finds modules, which MLX does not promise, so it is checked where it is
used: :class:`rvqstore.kernel_cache.CudaKernel` evaluates a configuration's first launch by reference
and, if that fails (no such file found, another naming), launches the binary from then on, for every
kernel of the process (:func:`give_up`). The directory must be ours and writable by us alone, and each
folder above it writable by no one else or sticky (anyone who could write there could swap the code we
launch); a group-writable one passes where the group is the user's own (a umask of 002 on systems with
user private groups). Otherwise no reference is published and kernels launch with their binaries.

``RVQSTORE_KERNEL_REF=0`` (or ``off``) never launches by reference; :data:`BY_REFERENCE` switches
between the two for configurations already checked (the benchmarks' ``binary`` variant).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from pathlib import Path

import mlx.core as mx

from . import user_cache

log = logging.getLogger("rvqstore.kernels")

ENV = "RVQSTORE_KERNEL_REF"
#: launch checked configurations by reference (False: with the binary, as before)
BY_REFERENCE = True
_PREFIX = b"rvqstore-kernel:"
_SEED = 0xC70F6907  # libstdc++'s seed for std::hash<std::string>
_MUL = 0xC6A4A7935BD1E995
_M64 = (1 << 64) - 1

_lock = threading.Lock()
_published: dict = {}  # (symbol, sha256) -> reference, this process
_gave_up: list = []  # the reason, once a launch by reference failed


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no") and not _gave_up


def std_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` of ``data`` on a 64-bit machine (``std::_Hash_bytes``,
    libstdc++-v3/libsupc++/hash_bytes.cc; unchanged since GCC 4.6)."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    h = (_SEED ^ (n * _MUL)) & _M64
    aligned = n & ~7
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        h ^= (shift_mix((word * _MUL) & _M64) * _MUL) & _M64
        h = (h * _MUL) & _M64
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _M64
    h = (shift_mix(h) * _MUL) & _M64
    return shift_mix(h)


def module_name(symbol: str, source: bytes | str) -> str:
    """The name MLX gives the module of a precompiled launch of ``symbol`` with ``source``."""
    data = source.encode() if isinstance(source, str) else source
    return f"{symbol}_{std_hash(data):x}"


def mlx_cache_dir() -> Path:
    """Where MLX looks for cached modules: ``$MLX_PTX_CACHE_DIR``, else ``<temp>/mlx/<version>/ptx`` with
    ``<temp>`` as C++'s ``std::filesystem::temp_directory_path`` finds it."""
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    if env:
        return Path(env)
    temp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(v)), "/tmp")
    return Path(temp) / "mlx" / mx.__version__ / "ptx"


def _private_group(gid: int) -> bool:
    """Group ``gid`` is this user's own (the user-private-group convention: named as the user, no other
    members), as a umask of 002 leaves directories group-writable on such systems."""
    try:
        import grp
        import pwd

        user = pwd.getpwuid(os.getuid())
        group = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and not group.gr_mem


def _only_we_write(st: os.stat_result) -> bool:
    return not st.st_mode & stat.S_IWOTH and (not st.st_mode & stat.S_IWGRP or _private_group(st.st_gid))


def _private(d: Path) -> bool:
    """``d`` is a real directory of ours that nobody else can write, nor swap: each folder above it is
    ours or root's and writable by no one else, or sticky (as ``/tmp``: others cannot rename what is ours)."""
    try:
        st = os.lstat(d)
    except OSError:
        return False
    if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and _only_we_write(st)):
        return False
    for up in Path(os.path.abspath(d)).parents:
        try:
            st = os.stat(up)
        except OSError:
            return False
        if st.st_uid not in (0, os.getuid()) or not (st.st_mode & stat.S_ISVTX or _only_we_write(st)):
            return False
    return True


def _write(path: Path, data: bytes) -> None:
    """``data`` at ``path`` (atomically), unless the file holds it already."""
    if path.is_file() and not path.is_symlink():
        try:
            if path.read_bytes() == data:
                return
        except OSError:
            pass
    user_cache.atomic_write(path, data)


def publish(symbol: str, binary: bytes) -> bytes | None:
    """A short source (bytes, as MLX takes the binary) that launches ``binary``'s ``symbol`` through MLX's
    module cache, or None (switched off, given up, or the cache directory is missing, not ours, or shared)."""
    if not enabled():
        return None
    digest = hashlib.sha256(binary).hexdigest()
    with _lock:
        ref = _published.get((symbol, digest))
        if ref is not None:
            return ref
        ref = _PREFIX + digest.encode()
        d = mlx_cache_dir()
        try:
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
            if not _private(d):
                log.info("kernel cache: %s is not a directory of ours alone; kernels launch with their binaries", d)
                return None
            base = d / module_name(symbol, ref)
            # the symbol list first: MLX takes the module once its code file is there
            _write(base.with_suffix(".txt"), f"{symbol}\t{symbol}\n".encode())
            _write(base.with_suffix(".ptx"), binary)
        except OSError as err:
            log.info("kernel cache: no reference launches (%s: %s)", type(err).__name__, err)
            return None
        _published[(symbol, digest)] = ref
        return ref


def give_up(reason: str) -> None:
    """A launch by reference failed: launch binaries from now on, in this process."""
    with _lock:
        if not _gave_up:
            _gave_up.append(reason)
            log.warning("kernel cache: a launch by reference failed (%s); kernels launch with their binaries",
                        reason[:300])


def reset() -> None:
    """Forget this process's publications and failure (tests)."""
    with _lock:
        _published.clear()
        _gave_up.clear()
