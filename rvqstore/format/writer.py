"""Writing ``.rvq`` files: sections stream to a temporary file beside the target, then fsync + rename.

An interrupted or failed save never leaves a partial file at ``path``: either the old file (if any)
is still there, untouched, or the complete new one is.  Permissions, symlinks and the temporary
files of killed saves follow the rules of the spec's section 14 (see :func:`write_rvq`).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from . import constants as C
from . import rans
from .checksum import checksum
from .errors import LimitExceededError, MalformedHeaderError, NotRegularFileError
from .header import Header, canonicalize, decode_header, encode_header, parse_header
from .preamble import pack_preamble
from .quantizer import check_quantizer
from .tempfiles import lock_temp, sweep_stale_temps, temp_name

#: Header keys the writer fills in itself; a caller's header must not carry them.
CONTAINER_KEYS = ("format_version", "required_features", "sections")

#: ``compress="auto"`` keeps a zstd frame only where it saves at least this fraction of the bytes.
#: Measured on SmolLM2-135M keys/values of 2048 tokens of real text (spec, section "Compression"):
#: 2-bit stage-1 codes save ~9 %, stage-2 codes ~3.5 %, bfloat16 scales 40-48 %, int32 tokens ~66 %,
#: fp16 dense keys/values 7-15 %; zstd level 3 decodes packed codes at 1.2-8 GB/s.
AUTO_MIN_SAVING = 0.02
#: ``compress``: "auto" (zstd where it saves >= 2 %), "zstd", "none"/"raw", "rans" (code sections
#: entropy-coded where that shrinks them, every other section as "auto"), "best" (each section the
#: smallest of raw, zstd and, for code sections, rans).
COMPRESS_MODES = ("auto", "zstd", "none", "raw", "rans", "best")
ZSTD_LEVEL = 3

_NP_NAMES = {(np.dtype(v[0]).kind, v[1]): k for k, v in C.DTYPES.items() if k != "bfloat16"}

ProgressFn = Callable[[int, "int | None"], None]


@dataclass
class Section:
    """One array to store.

    ``array`` is a numpy array or an ``mx.array``.  ``dtype`` names the element type on disk; when
    None it is taken from the array.  For ``"bfloat16"`` pass an ``mx.bfloat16`` array or a uint16
    numpy array holding the bit patterns.  ``codec`` overrides ``compress`` for this section (any of
    its modes; ``"rans"`` applies to packed code sections only, others then get ``"auto"``).
    """

    name: str
    layer: int
    kind: str
    array: Any
    dtype: str | None = None
    codec: str | None = None


def _to_numpy(sec: Section, path) -> tuple[np.ndarray, str]:
    a = sec.array
    mod = type(a).__module__
    if mod.startswith("mlx"):
        import mlx.core as mx  # only when the caller hands us mx arrays

        if a.dtype == mx.bfloat16:
            a = np.array(a.view(mx.uint16))
            name = "bfloat16"
        else:
            a = np.array(a)
            name = None
    else:
        a = np.asarray(a)
        name = None
    if a.dtype.kind not in "iuf":
        raise MalformedHeaderError(path, f"section {sec.name!r}: arrays of dtype {a.dtype} cannot be stored")
    if name is None:
        name = _NP_NAMES.get((a.dtype.kind, a.dtype.itemsize))
        if name is None:
            raise MalformedHeaderError(path, f"section {sec.name!r}: dtype {a.dtype} is not storable")
    a = np.ascontiguousarray(a, dtype=np.dtype(C.DTYPES[name][0]))  # little-endian, C order
    if sec.dtype is not None and sec.dtype != name:
        if not (sec.dtype == "bfloat16" and name == "uint16"):
            raise MalformedHeaderError(
                path, f"section {sec.name!r}: declared dtype {sec.dtype!r} but the array holds {name}")
        name = "bfloat16"
    return a, name


def _zstd_frame(data: memoryview, level: int) -> bytes:
    import zstandard

    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False,
                                    write_dict_id=False)
    return cctx.compress(data)


def _rans_stream(raw: memoryview, geometry: "tuple[int, int] | None") -> bytes | None:
    """rans stored bytes of a code section, or None when it has no code geometry, is not canonical
    packed codes, does not shrink, or would exceed the reader's expansion bound."""
    if geometry is None:
        return None
    # one table per coordinate pays where coordinates differ (real keys), one table where they do not
    stored = rans.encode_smallest(raw, *geometry)
    if stored is None or len(stored) >= len(raw) or len(raw) > C.MAX_ZSTD_RATIO * len(stored):
        return None
    return stored


def _choose(sec: Section, raw: memoryview, compress: str, level: int, path,
            geometry: "tuple[int, int] | None" = None) -> tuple[str, Any]:
    """(codec, stored bytes) for one section; ``geometry`` = (bits, dim) of a code section."""
    mode = sec.codec or compress
    if mode in ("raw", "none") or len(raw) == 0:
        return C.CODEC_RAW, raw
    if mode not in COMPRESS_MODES:
        raise ValueError(f"compress must be one of {', '.join(map(repr, COMPRESS_MODES))}, got {mode!r}")
    coded = _rans_stream(raw, geometry) if mode in ("rans", "best") else None
    if mode == "rans" and coded is not None:
        return C.CODEC_RANS, coded
    frame = _zstd_frame(raw, level)
    if mode == "best":
        options = [(len(raw), C.CODEC_RAW, raw)]
        if len(raw) <= C.MAX_ZSTD_RATIO * len(frame):
            options.append((len(frame), C.CODEC_ZSTD, frame))
        if coded is not None:
            options.append((len(coded), C.CODEC_RANS, coded))
        _, codec, stored = min(options, key=lambda o: o[0])
        return codec, stored
    if mode == "rans":
        mode = "auto"  # not a code section, or rans does not shrink it
    if len(raw) > C.MAX_ZSTD_RATIO * len(frame):  # too compressible for a reader's allocation bound
        return C.CODEC_RAW, raw
    if mode == "auto" and len(frame) > (1.0 - AUTO_MIN_SAVING) * len(raw):
        return C.CODEC_RAW, raw
    if mode == "zstd" and len(frame) >= len(raw):
        return C.CODEC_RAW, raw
    return C.CODEC_ZSTD, frame


def _write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


#: Mode of a new file: a snapshot holds the prompt's token ids (and a cache that can be inverted to
#: text), so it is private unless the caller says otherwise.
NEW_FILE_MODE = 0o600


def _open_temp(path: str) -> tuple[int, str]:
    for _ in range(100):
        tmp = temp_name(path, secrets.token_hex(6))
        try:
            # O_EXCL so we never reuse someone else's file; private until its final mode is set
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o600)
        except FileExistsError:
            continue
        lock_temp(fd)  # held until the fd closes: a sweeper never removes a live writer's temp
        return fd, tmp
    raise FileExistsError(f"could not create a temporary file next to {path}")


def resolve_target(path: str) -> tuple[str, int | None]:
    """The path to replace and the mode the new file gets (None: NEW_FILE_MODE).

    A symlink is written through: the link stays and its target is replaced atomically in the
    target's directory (a dangling link creates its target).  An existing file keeps its mode; a file
    without the owner's write bit is refused (``PermissionError``), as is anything but a regular file.
    """
    target = path
    if os.path.islink(path):
        target = os.path.realpath(path)
        if os.path.islink(target):  # realpath stops at a loop
            raise OSError(errno.ELOOP, "too many levels of symbolic links", path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target, None
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(path, "exists and is not a regular file; refusing to replace it")
    if not st.st_mode & stat.S_IWUSR:
        raise PermissionError(errno.EACCES, "the existing file is read-only (no owner write permission); "
                                            "refusing to replace it", path)
    return target, stat.S_IMODE(st.st_mode)


def fsync_dir(d: str) -> None:
    """Make a rename or link in directory ``d`` durable (best effort where directories cannot be synced)."""
    try:
        fd = os.open(d or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_rvq(
    path: "str | os.PathLike[str]",
    header: Mapping[str, Any],
    sections: Iterable[Section],
    *,
    compress: str = "auto",
    zstd_level: int = ZSTD_LEVEL,
    progress: ProgressFn | None = None,
    quantizer_check=check_quantizer,
    mode: int | None = None,
) -> Header:
    """Write an ``.rvq`` file atomically and return its validated :class:`Header`.

    ``header`` holds the content keys (``n_tokens``, ``layers``, ``quantizer``, ``model``,
    ``metadata``, and any extension keys); the writer adds ``format_version``,
    ``required_features`` and ``sections``.  ``sections`` may be a generator: each array is written
    (and may be freed) before the next is pulled.  ``compress``: ``"auto"`` (zstd where it saves at
    least 2 %), ``"zstd"`` (zstd wherever it saves anything), ``"none"`` (every section raw, so
    every section loads zero-copy), ``"rans"`` (packed code sections entropy-coded where that shrinks
    them, the rest as ``"auto"``) or ``"best"`` (each section the smallest of raw/zstd/rans).  A file
    with a rans section lists ``entropy-coded`` and is version [1, 1].  ``progress(done, total)`` is called after each section (total is None for an
    unsized iterable).  The file is validated by the reader's own rules before it is renamed into
    place, so a file this function writes always opens.

    The version is the oldest that holds the data: ``[1, 0]`` unless a 1.1 feature is used
    (``value_head_dim`` differing from ``head_dim``: per-side-geometry; a ``quantizers`` table:
    quantizer-table; a layer kind beyond rvq/dense: layer-kinds), ``[1, 2]`` with codec-state (a
    layer's ``sink_tokens`` > 0 or ``center_keys`` true, or a sink / mean section), and
    ``required_features`` lists exactly the features used.

    Files: a new file gets mode ``0o600`` (``mode`` overrides); an existing file keeps its mode
    (``mode`` overrides) and is refused if it lacks the owner's write bit; a symlink at ``path`` is
    written through (its target is replaced, in the target's directory; the link stays).  Temporary
    files are ``.NAME.<pid>.<random>.tmp`` beside the target, locked while their writer lives; after
    a successful write, unlocked temporaries of the same target (left by killed saves) are removed.
    """
    path = os.fspath(path)
    if mode is not None and (type(mode) is not int or not 0 <= mode <= 0o7777):
        raise ValueError(f"mode must be an int in 0..0o7777, got {mode!r}")
    if compress not in COMPRESS_MODES:
        raise ValueError(f"compress must be one of {', '.join(map(repr, COMPRESS_MODES))}, got {compress!r}")
    bad = [k for k in CONTAINER_KEYS if k in header]
    if bad:
        raise MalformedHeaderError(path, f"header keys {bad} are written by the writer, not the caller")
    try:
        content = canonicalize(dict(header))
    except TypeError as e:
        raise MalformedHeaderError(path, str(e)) from None
    content, feats_11 = _normalize_features(content)
    total = len(sections) if hasattr(sections, "__len__") else None  # type: ignore[arg-type]
    target, kept_mode = resolve_target(path)
    final_mode = mode if mode is not None else (kept_mode if kept_mode is not None else NEW_FILE_MODE)

    fd, tmp = _open_temp(target)
    ok = False
    try:
        _write_all(fd, bytes(C.PREAMBLE_SIZE))
        pos = C.PREAMBLE_SIZE
        rows = []
        for i, sec in enumerate(sections):
            if len(rows) >= C.MAX_SECTIONS:
                raise LimitExceededError(path, f"more than {C.MAX_SECTIONS} sections")
            arr, dtype = _to_numpy(sec, path)
            raw = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
            codec, stored = _choose(sec, raw, compress, zstd_level, path,
                                    _code_geometry(content, sec, dtype) if compress in ("rans", "best")
                                    or sec.codec in ("rans", "best") else None)
            off = C.align_up(pos)
            if off > pos:
                _write_all(fd, bytes(off - pos))
            _write_all(fd, stored)
            pos = off + len(stored)
            rows.append({
                "name": sec.name, "layer": int(sec.layer), "kind": sec.kind, "dtype": dtype,
                "shape": [int(d) for d in arr.shape], "offset": off, "length": len(stored),
                "codec": codec, "raw_length": len(raw), "checksum": checksum(stored),
            })
            del arr, raw, stored
            if progress is not None:
                progress(i + 1, total)

        if any(r["codec"] == C.CODEC_RANS for r in rows):
            feats_11 = [f for f in C.FEATURES_1_1 if f in feats_11 or f == C.FEATURE_ENTROPY_CODED]
        if any(_is_state_kind(r["kind"]) for r in rows) and C.FEATURE_CODEC_STATE not in feats_11:
            feats_11 = feats_11 + [C.FEATURE_CODEC_STATE]  # then the layer maps must say what they are
        feats = ([C.FEATURE_ZSTD] if any(r["codec"] == C.CODEC_ZSTD for r in rows) else []) + feats_11
        minor = _minor(feats_11)
        full = dict(content)
        full.update({"format_version": [C.FORMAT_MAJOR, minor], "required_features": feats,
                     "sections": rows})
        hbytes = encode_header(full)
        if len(hbytes) > C.MAX_HEADER_LENGTH:
            raise LimitExceededError(path, f"header would be {len(hbytes)} bytes, the limit is {C.MAX_HEADER_LENGTH}")
        h_off = C.align_up(pos)
        f_len = h_off + len(hbytes)
        # the reader's own validation, before anything is renamed into place
        parsed = parse_header(decode_header(hbytes, path), path=path, major=C.FORMAT_MAJOR,
                              minor=minor, flags=0, header_offset=h_off,
                              header_length=len(hbytes), file_length=f_len, quantizer_check=quantizer_check)
        _write_all(fd, bytes(h_off - pos))
        _write_all(fd, hbytes)
        pre = pack_preamble(minor=minor, header_offset=h_off, header_length=len(hbytes),
                            header_checksum=checksum(hbytes), file_length=f_len)
        os.lseek(fd, 0, os.SEEK_SET)
        _write_all(fd, pre)
        os.fchmod(fd, final_mode)
        os.fsync(fd)
        os.replace(tmp, target)  # still holding the temp's lock: no sweeper touches it before this
        ok = True
        os.close(fd)
        fd = -1
        fsync_dir(os.path.dirname(target))
        try:
            sweep_stale_temps(target)
        except OSError:
            pass  # best effort: a temp we cannot remove is no reason to fail a save that succeeded
        return parsed
    finally:
        if not ok:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if fd >= 0:
            os.close(fd)


def _minor(feats: list[str]) -> int:
    """The oldest minor version that holds a file using ``feats`` (besides zstd, a 1.0 feature)."""
    if any(f in C.FEATURES_1_2 for f in feats):
        return C.FORMAT_MINOR
    return C.FORMAT_MINOR_1_1 if feats else C.FORMAT_MINOR_BASE


_CHILD_KIND = re.compile(r"c(?:0|[1-9][0-9]{0,5})\.(.+)\Z")


def _is_state_kind(kind: str) -> bool:
    """``keys.sink`` / ``values.sink`` / ``keys.mean``, also as a list child's ``c<j>.`` kind."""
    m = _CHILD_KIND.match(kind)
    return (m.group(1) if m else kind) in C.CODEC_STATE_KINDS


def _normalize_features(content: dict) -> tuple[dict, list[str]]:
    """Drop ``value_head_dim`` where it equals ``head_dim`` and codec-state keys at their defaults
    (``sink_tokens`` 0, ``center_keys`` false); return the 1.1 / 1.2 features the header uses."""
    used: set[str] = set()
    layers = content.get("layers")

    def visit(row):
        if type(row) is not dict:
            return row
        row = dict(row)
        if "value_head_dim" in row:
            if row["value_head_dim"] == row.get("head_dim"):
                del row["value_head_dim"]
            else:
                used.add(C.FEATURE_PER_SIDE_GEOMETRY)
        if row.get("kind") not in C.LAYER_KINDS_1_0:
            used.add(C.FEATURE_LAYER_KINDS)
        if type(row.get("children")) is list:
            row["children"] = [visit(c) for c in row["children"]]
        if "key_quantizer" in row or "value_quantizer" in row:
            used.add(C.FEATURE_QUANTIZER_TABLE)
        for key, default in (("sink_tokens", 0), ("center_keys", False)):
            if key in row:
                if type(row[key]) is type(default) and row[key] == default:
                    del row[key]  # the default: a file without codec state stays what it was
                else:
                    used.add(C.FEATURE_CODEC_STATE)
        return row

    if type(layers) is list:
        content = dict(content, layers=[visit(r) for r in layers])
    if "quantizers" in content:
        used.add(C.FEATURE_QUANTIZER_TABLE)
    return content, [f for f in C.FEATURES_1_1 + C.FEATURES_1_2 if f in used]


def _code_geometry(content: dict, sec: Section, dtype: str) -> "tuple[int, int] | None":
    """(bits, dim) of a packed code section (``[c<j>.]keys|values.codes1|2`` of an rvq-coded layer),
    read from the header the file will carry; None for any other section or a header that does not say."""
    parts = sec.kind.split(".")
    if dtype != "uint32" or len(parts) not in (2, 3):
        return None
    try:
        layer = content["layers"][sec.layer]
        if len(parts) == 3:
            if not parts[0].startswith("c"):
                return None
            layer = layer["children"][int(parts[0][1:])]
        side, stage = parts[-2], parts[-1]
        if side not in ("keys", "values") or stage not in ("codes1", "codes2"):
            return None
        ref = layer.get("key_quantizer" if side == "keys" else "value_quantizer")
        q = content["quantizers"][ref] if ref is not None else content["quantizer"]
        bits, dim = q["bits1" if stage == "codes1" else "bits2"], q["dim"]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    if type(bits) is not int or type(dim) is not int or not 1 <= bits <= 4 or not 1 <= dim <= rans.MAX_DIM:
        return None
    return bits, dim
