"""Reading ``.rvq`` files lazily, from a path or any range source (``source.py``).

:func:`open_rvq` reads the 64-byte preamble and the header (with the at most 63 padding bytes before
it), nothing else, and validates them completely (every offset and length against the bytes present)
before returning.  Section data is read on demand: from a file through a read-only mmap (a raw section
becomes a zero-copy, read-only numpy view of the mapping after its checksum is verified), from other
sources with one ``read(offset, length)`` per section; a zstd section is checksummed, its frame header
checked against the declared size, then decompressed into exactly ``raw_length`` bytes.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from . import constants as C
from . import rans
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
from .limits import decoded_nbytes, resolve_decoded_limit
from .quantizer import check_quantizer
from .preamble import Preamble, check_header_checksum, parse_preamble
from .source import BytesSource, FileSource, RangeSource, source_name

#: threads of :meth:`RVQFile.read_sections` (sources that allow concurrent reads only)
READ_THREADS = max(1, min(8, os.cpu_count() or 1))
#: decoded bytes of compressed sections below which :meth:`RVQFile.read_sections` reads in turn: a pool
#: costs threads and a decompression context each (MBs of allocations) for a small file, and saves nothing
PARALLEL_MIN_BYTES = 8 << 20


def default_quantizer_check(quantizer: dict, layers, sections, path) -> None:
    """Validate the ``quantizer`` map by the rules of the quantizer that owns its name, if known.

    Unknown quantizer names are accepted here (the container is still readable); decoding such a
    file's codes is what fails.
    """
    check_quantizer(quantizer, layers, sections, path)


class RVQFile:
    """An open ``.rvq`` file.  Use as a context manager, or call :meth:`close`.

    Attributes: ``path`` (the path, or the range source's name), ``header`` (:class:`Header`),
    ``version`` ``(major, minor)``, ``sections`` (tuple of :class:`SectionInfo`, in file order),
    ``layers`` (tuple of :class:`LayerInfo`), ``file_length``.  Arrays returned by
    :meth:`read_section` for raw sections of a file are read-only views of the file mapping; they stay
    valid after :meth:`close` (the mapping is released when the last view is gone).
    """

    def __init__(self, path: str, source, pre: Preamble, header: Header, *, owns_source: bool = True):
        self.path = path
        self._source = source
        self._owns_source = owns_source
        self._pre = pre
        self.header = header
        self._by_name = {s.name: s for s in header.sections}
        # where the zero padding before each region starts
        self._pad_start: dict[str, int] = {}
        prev = C.PREAMBLE_SIZE
        for s in header.sections:
            self._pad_start[s.name] = prev
            prev = s.offset + s.length
        self._header_pad_start = prev
        self._closed = False
        self._codecs: dict = {}  # id(quantizer map) -> (map, codec): one codec per distinct map

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
    def concurrent_reads(self) -> bool:
        """Whether the source allows reads from several threads at once (files and byte strings do)."""
        return bool(getattr(self._source, "concurrent_reads", False))

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

    @property
    def quantizers(self) -> tuple[dict, ...] | None:
        """The ``quantizers`` table (feature quantizer-table), else None."""
        return self.header.quantizers

    def quantizer_for(self, layer: "int | LayerInfo", side: str) -> dict | None:
        """The quantizer map coding ``side`` (``"keys"``/``"values"``) of a layer (or list child).

        Works for 1.0 files (the one ``quantizer``) and 1.1 files (``quantizers`` table); None for a
        layer that is not rvq-coded.
        """
        info = self.layer(layer) if isinstance(layer, int) else layer
        return self.header.quantizer_for(info, side)

    def codec_for(self, layer: "int | LayerInfo", side: str, *, use_kernels: bool = True):
        """The :class:`rvqstore.codec.RVQCodec` of one layer side (see :meth:`quantizer_for`)."""
        return self._codec_from_map(self.quantizer_for(layer, side), use_kernels=use_kernels)

    def decoded_nbytes(self) -> int:
        """Bytes a full load produces: every layer's keys/values in their dtypes, state arrays, tokens."""
        return decoded_nbytes(self.header)

    def check_decoded_size(self, limit: int | None = None) -> int:
        """Raise :class:`LimitExceededError` if a full load would produce more than ``limit`` bytes.

        ``limit`` None: the environment variable ``RVQSTORE_MAX_DECODED_BYTES`` or the default
        (``constants.DEFAULT_MAX_DECODED_BYTES``).  Returns the decoded size.  Reads no section.
        """
        from .errors import LimitExceededError

        lim = resolve_decoded_limit(limit)
        n = self.decoded_nbytes()
        if n > lim:
            raise LimitExceededError(
                self.path, f"loading this file would decode {n:,} bytes, more than the limit of {lim:,} "
                           f"(pass a larger max_decoded_bytes, or set RVQSTORE_MAX_DECODED_BYTES)")
        return n

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
    def _check_open_and_size(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: I/O on a closed .rvq file")
        # the file must still be the size we validated: touching a mapping past EOF would SIGBUS
        cur = getattr(self._source, "current_size", None)
        size = cur() if cur is not None else self._source.size
        if size != self.file_length:
            raise TruncatedFileError(self.path, f"file changed size since it was opened ({self.file_length} -> {size} bytes)")

    def _bytes(self, offset: int, length: int):
        """``length`` bytes at ``offset``: a zero-copy view where the source offers one."""
        view = getattr(self._source, "view", None)
        data = view(offset, length) if view is not None else self._source.read(offset, length)
        if len(data) != length:
            raise TruncatedFileError(self.path, f"the source returned {len(data)} of {length} bytes at {offset}")
        return data if isinstance(data, memoryview) else memoryview(data)

    def _check_padding(self, start: int, end: int, what: str) -> None:
        if end > start and any(self._bytes(start, end - start)):
            raise LayoutError(self.path, f"non-zero padding bytes in [{start}, {end}) before {what}")

    def read_stored(self, name: str) -> memoryview:
        """The section's stored bytes (a zero-copy view where possible), after its checksum is verified."""
        s = self.section(name)
        self._check_open_and_size()
        self._check_padding(self._pad_start[s.name], s.offset, f"section {s.name!r}")
        view = self._bytes(s.offset, s.length)
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
        if s.codec == C.CODEC_RANS:
            data = rans.decode(stored, s.raw_length, f"section {s.name!r}", self.path)
            data.flags.writeable = False  # like every other section: read-only
        else:
            data = _zstd_decode(stored, s, self.path)
        stored.release()
        arr = np.frombuffer(data, dtype=dt, count=s.n_elements).reshape(s.shape)
        return arr

    def read_section_into(self, name: str, out) -> None:
        """Write the section's decoded bytes into ``out`` (a writable, C-contiguous buffer of exactly its
        ``raw_length`` bytes, e.g. a slot of pinned memory), verified as :meth:`read_section` verifies:
        the checksum before decompression, sizes after; zstd frames decompress straight into ``out``
        (no intermediate buffer). Bytes are raw: bfloat16 as its bit patterns. On an error ``out``
        holds unspecified bytes (it is the caller's scratch) and the error is the one read_section
        raises for the same section."""
        s = self.section(name)
        dst = np.asarray(out)
        if dst.dtype != np.uint8 or dst.ndim != 1 or not dst.flags.c_contiguous or not dst.flags.writeable:
            raise ValueError("read_section_into needs a writable, contiguous 1-D uint8 buffer")
        if dst.nbytes != s.raw_length:
            raise ValueError(f"section {s.name!r} decodes to {s.raw_length} bytes; the buffer holds {dst.nbytes}")
        stored = self.read_stored(name)
        try:
            if s.raw_length == 0:
                pass
            elif s.codec == C.CODEC_RAW:
                src = np.frombuffer(stored, dtype=np.uint8)
                np.copyto(dst, src)
                del src
            elif s.codec == C.CODEC_RANS:
                data = rans.decode(stored, s.raw_length, f"section {s.name!r}", self.path)
                np.copyto(dst, data.reshape(-1).view(np.uint8))
            else:
                _zstd_decode_into(stored, s, self.path, dst)
        finally:
            stored.release()

    def read_section_mx(self, name: str):
        """The section as an ``mx.array`` (bfloat16 sections as ``mx.bfloat16``).  Copies into MLX memory."""
        return self.typed(name, self._read_section_copy(name))

    def _read_section_copy(self, name: str):
        """The section copied into MLX memory, bfloat16 still as its uint16 bit patterns."""
        import mlx.core as mx

        return mx.array(self.read_section(name))

    def typed(self, name: str, raw):
        """An ``mx.array`` of the section's raw bytes' dtype as the section's MLX dtype (bfloat16 sections are
        read as their uint16 bit patterns; this views them as bfloat16)."""
        import mlx.core as mx

        return raw.view(mx.bfloat16) if self.section(name).dtype == "bfloat16" else raw

    def read_sections(self, names: Sequence[str], *, as_mx: bool = False,
                      then: Callable[[Any], Any] | None = None) -> list:
        """Several sections, each as :meth:`read_section` (or :meth:`read_section_mx`) returns it, read side
        by side on up to :data:`READ_THREADS` threads where the source allows concurrent reads (files and
        byte strings: their zstd and rANS sections go to the pool, raw ones are read in this thread) and
        the compressed ones decode to at least :data:`PARALLEL_MIN_BYTES`. ``then``: applied in this
        thread to each section as soon as it is read (e.g. a device copy started while the rest are
        read); what it returns is what comes back. Raises what reading them in turn would: the error of
        the first failing name."""
        read: Callable[[str], Any] = self._read_section_copy if as_mx else self.read_section
        # only decompression lets other threads run for long (the checksum binding holds the GIL, and
        # threads copying raw sections out of the mapping measured slower than one): compressed sections
        # go to the pool, raw ones are read here meanwhile
        packed = [n for n in names if self.section(n).codec != C.CODEC_RAW]
        big = sum(self.section(n).raw_length for n in packed) >= PARALLEL_MIN_BYTES
        workers = min(len(packed), READ_THREADS) if big and self.concurrent_reads else 0
        if workers <= 1:
            out = [read(name) if then is None else then(read(name)) for name in names]
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="rvq-read") as pool:
                out = _in_order(names, {name: pool.submit(read, name) for name in packed}, read, then)
        # views are graph operations: built here, in the caller's thread, not on the pool's
        return [self.typed(name, a) for name, a in zip(names, out)] if as_mx else out

    def layer_arrays(self, index: "int | LayerInfo", *, as_mx: bool = False) -> dict[str, Any]:
        """All known-kind sections of a layer (or of a list child, given as its LayerInfo), decoded and
        verified: ``{kind: array}`` (a list child's kinds without their ``c<j>.`` prefix)."""
        layer = self.layer(index) if isinstance(index, int) else index
        return dict(zip(layer.sections, self.read_sections(list(layer.sections.values()), as_mx=as_mx)))

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
        if self.header.quantizers is not None:
            raise UnknownFeatureError(self.path, "this file has one quantizer per layer side "
                                                 "('quantizer-table'): use codec_for(layer, side)")
        return self._codec_from_map(self.quantizer, use_kernels=use_kernels)

    def _codec_from_map(self, q: dict | None, *, use_kernels: bool):
        """The codec of a quantizer map, built once per map and ``use_kernels`` (layers that share a
        map share the codec: its tables are built once, not once per layer side)."""
        key = (id(q), use_kernels)
        if key in self._codecs and self._codecs[key][0] is q:
            return self._codecs[key][1]
        codec = self._build_codec(q, use_kernels=use_kernels)
        self._codecs[key] = (q, codec)
        return codec

    def _build_codec(self, q: dict | None, *, use_kernels: bool):
        from .quantizer import QUANTIZER_NAME

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
        self._check_open_and_size()
        stored = raw = 0
        for i, s in enumerate(self.sections):
            arr = self.read_section(s.name)
            stored += s.length
            raw += s.raw_length
            del arr
            if progress is not None:
                progress(i + 1, len(self.sections))
        self._check_padding(self._header_pad_start, self.header.header_offset, "the header")
        if decode is not None:
            decode(self)
        return {"sections": len(self.sections), "stored_bytes": stored, "raw_bytes": raw,
                "file_bytes": self.file_length}

    # ---- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_source:
            self._source.close()

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


def _in_order(names: Sequence[str], pending: dict, read: Callable[[str], Any],
              then: Callable[[Any], Any] | None = None) -> list:
    """Each name's result, the ``pending`` ones from their futures, the rest read here meanwhile (``then``
    applied to each here, as it comes); raises the error of the first failing name, as reading them in turn
    would (later futures are cancelled)."""
    done: dict[str, Any] = {}
    failed = None
    for i, name in enumerate(names):
        if name not in pending:
            try:
                done[name] = read(name) if then is None else then(read(name))
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the earlier names
                done[name], failed = err, i
                break
    if failed is not None:
        for name in names[failed + 1:]:
            if name in pending:
                pending[name].cancel()
    out = []
    for name in names[: None if failed is None else failed + 1]:
        if name in done:
            value = done[name]
            if isinstance(value, BaseException):
                raise value
        else:
            value = pending[name].result()
            if then is not None:
                value = then(value)
        out.append(value)
    return out


def _zstd_check(stored: memoryview, s: SectionInfo, path: str):
    """The frame's parameters, after the checks both decoders make: magic, header, content size, no
    dictionary."""
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
    return params


def _zstd_decode(stored: memoryview, s: SectionInfo, path: str) -> bytes:
    import zstandard

    _zstd_check(stored, s, path)
    try:
        out = zstandard.ZstdDecompressor().decompress(stored, max_output_size=s.raw_length,
                                                       allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise MalformedSectionError(path, f"section {s.name!r}: zstd frame does not decode ({e})") from None
    if len(out) != s.raw_length:  # pragma: no cover - libzstd checks the content size itself
        raise MalformedSectionError(
            path, f"section {s.name!r}: zstd frame decodes to {len(out)} bytes, the header declares {s.raw_length}")
    return out


def _zstd_frame_length(stored: memoryview, header_size: int, has_checksum: bool) -> int | None:
    """The bytes of the one zstd frame at the start of ``stored``: its header, its blocks (each a 3-byte
    header and its stored bytes: RFC 8878 3.1.1.2) and the optional 4-byte checksum; None where a block
    header runs past the end or is of the reserved type."""
    buf = memoryview(stored).cast("B")
    pos, end = header_size, len(buf)
    while True:
        if pos + 3 > end:
            return None
        h = buf[pos] | (buf[pos + 1] << 8) | (buf[pos + 2] << 16)
        kind, size = (h >> 1) & 3, h >> 3
        if kind == 3:
            return None
        pos += 3 + (1 if kind == 1 else size)
        if h & 1:
            return pos + (4 if has_checksum else 0)


def _zstd_decode_into(stored: memoryview, s: SectionInfo, path: str, dst: np.ndarray) -> None:
    """Decompress the section's one zstd frame into ``dst`` (exactly ``raw_length`` bytes), refusing what
    :func:`_zstd_decode` refuses: a bad header, another size, a dictionary, bytes after the frame."""
    import zstandard

    params = _zstd_check(stored, s, path)
    try:
        hsize = zstandard.frame_header_size(stored)
    except zstandard.ZstdError as e:
        raise MalformedSectionError(path, f"section {s.name!r}: bad zstd frame header ({e})") from None
    if _zstd_frame_length(stored, hsize, params.has_checksum) != len(stored):
        raise MalformedSectionError(path, f"section {s.name!r}: zstd frame does not decode (its blocks do not "
                                          f"end at the section's {len(stored)} stored bytes)")
    view = memoryview(dst)
    n = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=False) as r:
            while n < len(view):
                got = r.readinto(view[n:])
                if not got:
                    break
                n += got
            more = r.read(1) if n == len(view) else b""
    except zstandard.ZstdError as e:
        raise MalformedSectionError(path, f"section {s.name!r}: zstd frame does not decode ({e})") from None
    finally:
        view.release()
    if n != s.raw_length or more:
        got = f"{n} bytes" if not more else f"more than {n} bytes"
        raise MalformedSectionError(
            path, f"section {s.name!r}: zstd frame decodes to {got}, the header declares {s.raw_length}")


def open_rvq(source: "str | os.PathLike[str] | RangeSource", *,
             quantizer_check: QuantizerCheck | None = default_quantizer_check) -> RVQFile:
    """Open an ``.rvq`` file: read and fully validate the preamble and header, read no section yet.

    ``source`` is a path, a bytes-like object, or a range source (an object with ``size`` and
    ``read(offset, length) -> bytes``, see :mod:`rvqstore.format.source`).  A path that is not a
    regular file (a FIFO, a device, a directory) is refused without blocking
    (:class:`NotRegularFileError`).  Raises a :class:`~rvqstore.format.errors.FormatError`
    subclass for any invalid file, and ``OSError`` when the file cannot be opened at all.
    """
    owns = True
    if isinstance(source, (str, os.PathLike)):
        src = FileSource(source)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        src = BytesSource(source)
    elif isinstance(getattr(source, "size", None), int) and callable(getattr(source, "read", None)):
        src, owns = source, False
    else:
        raise TypeError(f"open_rvq needs a path, bytes, or a range source with size and read(offset, length); "
                        f"got {type(source).__name__}")
    name = source_name(src)
    try:
        size = src.size
        if size < 0:
            raise TruncatedFileError(name, f"the source reports a size of {size} bytes")
        head = bytes(src.read(0, min(C.PREAMBLE_SIZE, size)))
        pre = parse_preamble(head, size, name)
        # the header and the (at most 63) padding bytes before it, in one read
        pad = min(C.ALIGNMENT - 1, pre.header_offset - C.PREAMBLE_SIZE)
        tail = bytes(src.read(pre.header_offset - pad, pad + pre.header_length))
        if len(tail) != pad + pre.header_length:
            raise TruncatedFileError(name, "file shrank while being read")
        hbytes = tail[pad:]
        check_header_checksum(pre, hbytes, name)
        obj = decode_header(hbytes, name)
        header = parse_header(obj, path=name, major=pre.major, minor=pre.minor, flags=pre.flags,
                              header_offset=pre.header_offset, header_length=pre.header_length,
                              file_length=pre.file_length, quantizer_check=quantizer_check)
        f = RVQFile(name, src, pre, header, owns_source=owns)
        # the padding before the header is checked at open: no later read covers it
        start = f._header_pad_start
        if any(tail[pad - (pre.header_offset - start): pad]):
            raise LayoutError(name, f"non-zero padding bytes in [{start}, {pre.header_offset}) before the header")
        return f
    except BaseException:
        if owns:
            src.close()
        raise


__all__ = ["RVQFile", "open_rvq", "default_quantizer_check", "FormatError"]
