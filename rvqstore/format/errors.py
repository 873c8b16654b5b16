"""Errors raised for malformed, damaged or unsupported ``.rvq`` files.

Every one derives from :class:`FormatError`, itself an :class:`rvqstore.errors.RVQError`.  The message
always starts with the file's path, then says what is wrong::

    FormatError: /tmp/a.rvq: section 'layers.0.keys.codes1' checksum mismatch (stored 0x..., computed 0x...)

``err.path`` and ``err.detail`` hold the two parts.
"""

from __future__ import annotations

import os

from ..errors import RVQError


class FormatError(RVQError):
    """A file is not a valid ``.rvq`` file this reader can read (or a writer was asked to write one)."""

    def __init__(self, path: "str | os.PathLike[str] | None", detail: str):
        self.path = None if path is None else os.fspath(path)
        self.detail = detail
        super().__init__(f"{self.path}: {detail}" if self.path is not None else detail)


class BadMagicError(FormatError):
    """The first 8 bytes are not the ``.rvq`` signature (not an rvq file, or text-mode damage)."""


class UnsupportedVersionError(FormatError):
    """The file's major version is not one this reader implements."""


class UnknownFeatureError(FormatError):
    """The file sets a flag bit or lists a required feature this reader does not implement."""


class TruncatedFileError(FormatError):
    """The file holds fewer bytes than its preamble or header says it must."""


class ChecksumMismatchError(FormatError):
    """A stored checksum (preamble, header or section) does not match the bytes."""


class LimitExceededError(FormatError):
    """A declared size or count is beyond this format's limits."""


class MalformedHeaderError(FormatError):
    """The header is not valid msgpack, or does not follow the header schema."""


class LayoutError(FormatError):
    """Regions are misplaced: overlapping, unsorted, misaligned, with holes, or non-zero padding."""


class TrailingDataError(LayoutError):
    """The file holds bytes after the end its preamble declares."""


class NotRegularFileError(FormatError):
    """The path is a FIFO, device, socket or directory: refused without reading (or blocking on) it."""


class MalformedSectionError(FormatError):
    """A section's stored bytes (e.g. its zstd frame) do not decode to what the header declares."""


class SectionNotFoundError(RVQError, KeyError):
    """The caller asked for a section or layer the file does not have (not a damaged file)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


__all__ = [
    "FormatError",
    "BadMagicError",
    "UnsupportedVersionError",
    "UnknownFeatureError",
    "TruncatedFileError",
    "ChecksumMismatchError",
    "LimitExceededError",
    "MalformedHeaderError",
    "LayoutError",
    "TrailingDataError",
    "MalformedSectionError",
    "NotRegularFileError",
    "SectionNotFoundError",
]
