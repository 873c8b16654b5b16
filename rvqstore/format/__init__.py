"""The ``.rvq`` container, version 1 (revisions 1.0, 1.1 and 1.2): a spec'd, checksummed, lazily readable
file of KV-cache sections.

The byte-level specification is ``format_spec/rvq-v1.md``.  Public API::

    write_rvq(path, header, sections, *, compress="auto", progress=None, mode=None) -> Header
    open_rvq(path | bytes | range_source) -> RVQFile   # reads only the preamble and the header
    RVQFile.quantizer_for(layer, side) / codec_for(layer, side) / layer_arrays(layer) / check_decoded_size()
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
    NotRegularFileError,
    SectionNotFoundError,
    TrailingDataError,
    TruncatedFileError,
    UnknownFeatureError,
    UnsupportedVersionError,
)
from .header import Header, LayerInfo, SectionInfo
from .reader import RVQFile, open_rvq
from .source import BytesSource, FileSource, RangeSource
from .tempfiles import sweep_stale_temps
from .writer import Section, write_rvq

__all__ = [
    "FORMAT_MAJOR", "FORMAT_MINOR", "MAGIC",
    "open_rvq", "RVQFile", "write_rvq", "Section", "Header", "LayerInfo", "SectionInfo",
    "FormatError", "BadMagicError", "UnsupportedVersionError", "UnknownFeatureError", "TruncatedFileError",
    "ChecksumMismatchError", "LimitExceededError", "MalformedHeaderError", "LayoutError", "TrailingDataError",
    "MalformedSectionError", "NotRegularFileError", "SectionNotFoundError",
    "RangeSource", "FileSource", "BytesSource", "sweep_stale_temps",
]
