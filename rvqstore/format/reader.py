"""Reading ``.rvq`` files lazily.

:func:`open_rvq` reads the 64-byte preamble and the header, nothing else, and validates both
completely (every offset and length against the bytes present) before returning.  Section data is
read on demand through a read-only mmap: a raw section becomes a zero-copy, read-only numpy view of
the mapping after its checksum is verified; a zstd section is checksummed, its frame header checked
against the declared size, then decompressed into exactly ``raw_length`` bytes.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any, Callable

import numpy as np

from . import constants as C
from .checksum import checksum
from .errors import (
    ChecksumMismatchError,
    FormatError,
    LayoutError,
    MalformedHeaderError,
    MalformedSectionError,
    SectionNotFoundError,
    TruncatedFileError,
    UnknownFeatureError,
)
from .header import Header, LayerInfo, QuantizerCheck, SectionInfo, decode_header, parse_header
from .quantizer import check_quantizer
from .preamble import Preamble, check_header_checksum, parse_preamble


def _pread_exact(fd: int, n: int, off: int) -> bytes:
    chunks = []
    while n > 0:
        b = os.pread(fd, n, off)
        if not b:
            break
        chunks.append(b)
        n -= len(b)
        off += len(b)
    return b"".join(chunks)


def default_quantizer_check(quantizer: dict, layers, sections, path) -> None:
    """Validate the ``quantizer`` map by the rules of the quantizer that owns its name, if known.

    Unknown quantizer names are accepted here (the container is still readable); decoding such a
    file's codes is what fails.
    """
    check_quantizer(quantizer, layers, sections, path)


class RVQFile:
    """An open ``.rvq`` file.  Use as a context manager, or call :meth:`close`.

    Attributes: ``path``, ``header`` (:class:`Header`), ``version`` ``(major, minor)``,
    ``sections`` (tuple of :class:`SectionInfo`, in file order), ``layers`` (tuple of
    :class:`LayerInfo`), ``file_length``.  Arrays returned by :meth:`read_section` for raw
    sections are read-only views of the file mapping; they stay valid after :meth:`close` (the
    mapping is released when the last view is gone).
    """

    def __init__(self, path: str, fd: int, pre: Preamble, header: Header):
        self.path = path
        self._fd = fd
        self._pre = pre
        self.header = header
        self._mm: mmap.mmap | None = None
        self._lock = threading.Lock()
        self._by_name = {s.name: s for s in header.sections}
        # where the zero padding before each region starts
        self._pad_start: dict[str, int] = {}
        prev = C.PREAMBLE_SIZE
        for s in header.sections:
            self._pad_start[s.name] = prev
            prev = s.offset + s.length
        self._header_pad_start = prev
        self._closed = False

    # ---- metadata (no data reads) -----------------------------------------------------------------
    @property
    def version(self) -> tuple[int, int]:
        return (self.header.major, self.header.minor)

    @property
    def sections(self) -> tuple[SectionInfo, ...]:
        return self.header.sections

    @property
    def layers(self) -> tuple[LayerInfo, ...]:
        return self.header.layers

    @property
    def file_length(self) -> int:
        return self.header.file_length

    @property
    def n_tokens(self) -> int:
        return self.header.n_tokens

    @property
    def quantizer(self) -> dict | None:
        return self.header.quantizer

    @property
    def model(self) -> dict | None:
        return self.header.model

    @property
    def metadata(self) -> dict:
        return self.header.metadata

    def section(self, name: str) -> SectionInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise SectionNotFoundError(f"{self.path}: no section named {name!r}") from None

    def layer(self, index: int) -> LayerInfo:
        if not isinstance(index, int) or not 0 <= index < len(self.layers):
            raise SectionNotFoundError(f"{self.path}: no layer {index!r} (the file has {len(self.layers)})")
        return self.layers[index]

    # ---- data -------------------------------------------------------------------------------------
    def _map(self) -> mmap.mmap:
        if self._closed:
            raise ValueError(f"{self.path}: I/O on a closed .rvq file")
        # the file must still be the size we validated: touching a mapping past EOF would SIGBUS
        size = os.fstat(self._fd).st_size
        if size != self.file_length:
            raise TruncatedFileError(self.path, f"file changed size since it was opened ({self.file_length} -> {size} bytes)")
        with self._lock:
            if self._mm is None:
                self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            return self._mm

    def _check_padding(self, start: int, end: int, mm, what: str) -> None:
        if end > start and any(mm[start:end]):
            raise LayoutError(self.path, f"non-zero padding bytes in [{start}, {end}) before {what}")

    def read_stored(self, name: str) -> memoryview:
        """The section's stored bytes (a zero-copy view of the mapping), after its checksum is verified."""
        s = self.section(name)
        mm = self._map()
        self._check_padding(self._pad_start[s.name], s.offset, mm, f"section {s.name!r}")
        view = memoryview(mm)[s.offset: s.offset + s.length]
        got = checksum(view)
        if got != s.checksum:
            view.release()
            raise ChecksumMismatchError(
                self.path, f"section {s.name!r} checksum mismatch (stored {s.checksum:#018x}, computed {got:#018x})")
        return view

    def read_section(self, name: str) -> np.ndarray:
        """The decoded array of a section, verified (checksum before decompression, sizes after).

        bfloat16 sections come back as uint16 bit patterns (see :meth:`read_section_mx`).  Raw
        sections are zero-copy read-only views of the mapping; zstd ones are read-only arrays over a
        fresh buffer of exactly ``raw_length`` bytes.
        """
        s = self.section(name)
        stored = self.read_stored(name)
        dt = s.numpy_dtype
        if s.codec == C.CODEC_RAW:
            if s.raw_length == 0:
                stored.release()
                arr = np.empty(s.shape, dtype=dt)
                arr.flags.writeable = False
                return arr
            arr = np.frombuffer(stored, dtype=dt, count=s.n_elements).reshape(s.shape)
            return arr
        data = _zstd_decode(stored, s, self.path)
        stored.release()
        arr = np.frombuffer(data, dtype=dt, count=s.n_elements).reshape(s.shape)
        return arr

    def read_section_mx(self, name: str):
        """The section as an ``mx.array`` (bfloat16 sections as ``mx.bfloat16``).  Copies into MLX memory."""
        import mlx.core as mx

        s = self.section(name)
        arr = self.read_section(name)
        out = mx.array(arr)
        if s.dtype == "bfloat16":
            out = out.view(mx.bfloat16)
        return out

    def layer_arrays(self, index: int, *, as_mx: bool = False) -> dict[str, Any]:
        """All known-kind sections of a layer, decoded and verified: ``{kind: array}``."""
        layer = self.layer(index)
        read: Callable[[str], Any] = self.read_section_mx if as_mx else self.read_section
        return {kind: read(name) for kind, name in layer.sections.items()}

    def tokens(self) -> np.ndarray | None:
        """The int32 token ids of the cached prefix, or None if the file stores none."""
        for s in self.sections:
            if s.kind == C.KIND_TOKENS:
                return self.read_section(s.name)
        return None

    def codec(self, *, use_kernels: bool = True):
        """The :class:`rvqstore.codec.RVQCodec` described by the header (tables and signs from the file).

        Raises :class:`UnknownFeatureError` when the file has no quantizer or one this library does not
        implement, and :class:`MalformedHeaderError` when the codec refuses the map.
        """
        from .quantizer import QUANTIZER_NAME

        q = self.quantizer
        if q is None or q.get("name") != QUANTIZER_NAME:
            name = None if q is None else q.get("name")
            raise UnknownFeatureError(self.path, f"quantizer {name!r} cannot be decoded by this library "
                                                 f"(it implements {QUANTIZER_NAME!r})")
        from ..codec import RVQCodec
        from ..errors import RVQError

        try:
            return RVQCodec.from_header(q, use_kernels=use_kernels)
        except RVQError as e:
            raise MalformedHeaderError(self.path, f"header.quantizer: {e}") from None

    def verify(self, *, decode: Callable[["RVQFile"], None] | None = None,
               progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
        """Check every checksum, every padding byte, and decode every section (unknown kinds too).

        Raises the first :class:`FormatError` found.  ``decode(self)``, if given, then runs a
        content-level check (e.g. decoding the codes with the codec).  Returns counts.
        """
        mm = self._map()
        stored = raw = 0
        for i, s in enumerate(self.sections):
            arr = self.read_section(s.name)
            stored += s.length
            raw += s.raw_length
            del arr
            if progress is not None:
                progress(i + 1, len(self.sections))
        self._check_padding(self._header_pad_start, self.header.header_offset, mm, "the header")
        if decode is not None:
            decode(self)
        return {"sections": len(self.sections), "stored_bytes": stored, "raw_bytes": raw,
                "file_bytes": self.file_length}

    # ---- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # arrays still view it; the mapping goes when they do
            self._mm = None
        os.close(self._fd)

    def __enter__(self) -> "RVQFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"RVQFile({self.path!r}, v{self.header.major}.{self.header.minor}, {len(self.layers)} layers, "
                f"{self.n_tokens} tokens, {len(self.sections)} sections, {self.file_length} bytes)")


def _zstd_decode(stored: memoryview, s: SectionInfo, path: str) -> bytes:
    import zstandard

    if len(stored) < 4 or bytes(stored[:4]) != C.ZSTD_MAGIC:
        raise MalformedSectionError(path, f"section {s.name!r}: stored bytes are not a zstd frame")
    try:
        params = zstandard.get_frame_parameters(stored)
    except zstandard.ZstdError as e:
        raise MalformedSectionError(path, f"section {s.name!r}: bad zstd frame header ({e})") from None
    if params.content_size != s.raw_length:
        cs = "no content size" if params.content_size == zstandard.CONTENTSIZE_UNKNOWN else f"{params.content_size} bytes"
        raise MalformedSectionError(
            path, f"section {s.name!r}: zstd frame declares {cs}, the header declares {s.raw_length}")
    if params.dict_id != 0:
        raise MalformedSectionError(path, f"section {s.name!r}: zstd frame needs dictionary {params.dict_id}")
    try:
        out = zstandard.ZstdDecompressor().decompress(stored, max_output_size=s.raw_length,
                                                       allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise MalformedSectionError(path, f"section {s.name!r}: zstd frame does not decode ({e})") from None
    if len(out) != s.raw_length:  # pragma: no cover - libzstd checks the content size itself
        raise MalformedSectionError(
            path, f"section {s.name!r}: zstd frame decodes to {len(out)} bytes, the header declares {s.raw_length}")
    return out


def open_rvq(path: "str | os.PathLike[str]", *, quantizer_check: QuantizerCheck | None = default_quantizer_check
             ) -> RVQFile:
    """Open an ``.rvq`` file: read and fully validate the preamble and header, map nothing yet.

    Raises a :class:`~rvqstore.format.errors.FormatError` subclass for any invalid file, and
    ``OSError`` when the file cannot be opened at all.
    """
    spath = os.fspath(path)
    fd = os.open(spath, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        size = st.st_size
        head = _pread_exact(fd, min(C.PREAMBLE_SIZE, size), 0)
        pre = parse_preamble(head, size, spath)
        hbytes = _pread_exact(fd, pre.header_length, pre.header_offset)
        if len(hbytes) != pre.header_length:
            raise TruncatedFileError(spath, "file shrank while being read")
        check_header_checksum(pre, hbytes, spath)
        obj = decode_header(hbytes, spath)
        header = parse_header(obj, path=spath, major=pre.major, minor=pre.minor, flags=pre.flags,
                              header_offset=pre.header_offset, header_length=pre.header_length,
                              file_length=pre.file_length, quantizer_check=quantizer_check)
        return RVQFile(spath, fd, pre, header)
    except BaseException:
        os.close(fd)
        raise


__all__ = ["RVQFile", "open_rvq", "default_quantizer_check", "FormatError"]
