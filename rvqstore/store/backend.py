"""What a storage backend does for the prefix store, and how a URL picks one.

Objects are immutable once published: :meth:`create` publishes atomically and never replaces an
existing object (a reader never sees a partial or changing block); :meth:`put` (overwrite) is used
only for the small files that carry no cache data (markers, namespace descriptions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .errors import StoreURLError


@dataclass(frozen=True)
class ObjectInfo:
    path: str  # relative to the store root, "/"-separated
    size: int
    mtime: float  # seconds since the epoch: last write (markers: last use)


class Backend(Protocol):
    url: str

    def create(self, path: str, data: bytes) -> bool:
        """Publish ``data`` at ``path`` atomically unless something is there; True if this call did."""

    def put(self, path: str, data: bytes) -> None:
        """Write ``data`` at ``path``, replacing what is there (atomically)."""

    def get(self, path: str, max_bytes: int | None = None) -> bytes | None:
        """The whole object, or None if there is none; larger than ``max_bytes``: CorruptBlockError."""

    def exists(self, path: str) -> bool: ...

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose path starts with ``prefix`` (recursively)."""

    def delete(self, path: str) -> None:
        """Remove ``path``; no error if it is already gone."""

    def local_path(self, path: str) -> str | None:
        """A filesystem path to read ``path`` from in place (local backends), else None."""


def open_backend(url: str, **options) -> Backend:
    """``/a/dir``, ``file:///a/dir`` or ``s3://bucket/prefix`` (options: see :class:`S3Backend`)."""
    if not isinstance(url, str) or not url:
        raise StoreURLError(f"a store URL must be a non-empty string, got {url!r}")
    if url.startswith("s3://"):
        from .s3 import S3Backend

        return S3Backend(url, **options)
    if "://" in url and not url.startswith("file://"):
        raise StoreURLError(f"{url}: unsupported store URL (use a directory, file:///dir or s3://bucket/prefix)")
    if options:
        raise StoreURLError(f"options {sorted(options)} apply to s3:// stores only")
    from .local import LocalBackend

    return LocalBackend(url[len("file://"):] if url.startswith("file://") else url)
