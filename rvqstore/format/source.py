"""Where a reader gets a file's bytes: the small *range source* protocol, for a file or a byte string.

A range source is any object with

- ``size``: the number of bytes (an ``int``), and
- ``read(offset, length) -> bytes``: exactly ``length`` bytes from ``offset`` (fewer only past the end),

so an S3 object, an HTTP range reader or a cache entry can be opened with :func:`open_rvq` without a
file on disk.  Two implementations live here: :class:`FileSource` (a regular file, opened without
ever blocking: a FIFO or device path is refused) and :class:`BytesSource` (a bytes-like object).
Sources MAY also offer ``view(offset, length) -> memoryview`` (zero-copy) and ``current_size()``
(the size now, to notice a file that changed after it was opened), and set ``concurrent_reads = True``
when ``read``/``view`` may be called from several threads at once (the reader then reads sections side
by side); the reader uses them when there.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from typing import Protocol, runtime_checkable

from .errors import NotRegularFileError


@runtime_checkable
class RangeSource(Protocol):
    size: int

    def read(self, offset: int, length: int) -> bytes: ...


class FileSource:
    """A regular file, read with ``pread`` and viewed through a read-only mmap (zero-copy sections)."""

    concurrent_reads = True  # pread takes its offset; the mapping is made under a lock

    def __init__(self, path: "str | os.PathLike[str]"):
        self.path = os.fspath(path)
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; on a
        # regular file the flag changes nothing.
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_BINARY", 0)
                     | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                what = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                        else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device" if
                        stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
                raise NotRegularFileError(self.path, f"is {what}; an .rvq file must be a regular file")
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = st.st_size
        self._mm: mmap.mmap | None = None
        self._lock = threading.Lock()

    def read(self, offset: int, length: int) -> bytes:
        chunks = []
        while length > 0:
            b = os.pread(self.fd, length, offset)
            if not b:
                break
            chunks.append(b)
            length -= len(b)
            offset += len(b)
        return b"".join(chunks)

    def current_size(self) -> int:
        return os.fstat(self.fd).st_size

    def view(self, offset: int, length: int) -> memoryview:
        """Zero-copy view; the caller has checked that the file still has its validated size (a
        mapping touched past EOF raises SIGBUS)."""
        with self._lock:
            if self._mm is None:
                self._mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
            return memoryview(self._mm)[offset: offset + length]

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # arrays still view it; the mapping goes when they do
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class BytesSource:
    """An in-memory file (``bytes``, ``bytearray``, ``memoryview``, mmap): views, no copies."""

    concurrent_reads = True

    def __init__(self, data, name: str = "<bytes>"):
        self._mv = memoryview(data).cast("B")
        self.size = len(self._mv)
        self.path = name

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._mv[offset: offset + length])

    def view(self, offset: int, length: int) -> memoryview:
        return self._mv[offset: offset + length]

    def close(self) -> None:
        pass


def source_name(source) -> str:
    """The name error messages start with: the path, or the source's ``path``/``name``, or its repr."""
    for attr in ("path", "name"):
        v = getattr(source, attr, None)
        if isinstance(v, str):
            return v
    return f"<{type(source).__name__}>"


__all__ = ["RangeSource", "FileSource", "BytesSource", "source_name"]
