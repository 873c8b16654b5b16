"""The ``.rvq`` container, version 1: a spec'd, checksummed, lazily readable file of KV-cache sections.

The byte-level specification is ``format_spec/rvq-v1.md``.  Public API::

    write_rvq(path, header, sections, *, compress="auto", progress=None) -> Header
    open_rvq(path) -> RVQFile        # reads only the preamble and the header
"""

from .constants import FORMAT_MAJOR, FORMAT_MINOR, MAGIC
from .errors import (
    BadMagicError,
    ChecksumMismatchError,
    FormatError,
    LayoutError,
    LimitExceededError,
    MalformedHeaderError,
    MalformedSectionError,
    SectionNotFoundError,
    TrailingDataError,
    TruncatedFileError,
    UnknownFeatureError,
    UnsupportedVersionError,
)
from .header import Header, LayerInfo, SectionInfo
from .reader import RVQFile, open_rvq
from .writer import Section, write_rvq

__all__ = [
    "FORMAT_MAJOR", "FORMAT_MINOR", "MAGIC",
    "open_rvq", "RVQFile", "write_rvq", "Section", "Header", "LayerInfo", "SectionInfo",
    "FormatError", "BadMagicError", "UnsupportedVersionError", "UnknownFeatureError", "TruncatedFileError",
    "ChecksumMismatchError", "LimitExceededError", "MalformedHeaderError", "LayoutError", "TrailingDataError",
    "MalformedSectionError", "SectionNotFoundError",
]
