"""The 64-byte preamble: packing, and validation steps P1..P9 of the spec (section 13)."""

from __future__ import annotations

from dataclasses import dataclass

from . import constants as C
from .checksum import checksum
from .errors import (
    BadMagicError,
    ChecksumMismatchError,
    LayoutError,
    LimitExceededError,
    MalformedHeaderError,
    TrailingDataError,
    TruncatedFileError,
    UnknownFeatureError,
    UnsupportedVersionError,
)


@dataclass(frozen=True)
class Preamble:
    major: int
    minor: int
    flags: int
    header_offset: int
    header_length: int
    header_checksum: int
    file_length: int
    reserved: int
    preamble_checksum: int


def pack_preamble(*, major: int = C.FORMAT_MAJOR, minor: int = C.FORMAT_MINOR_BASE, flags: int = 0,
                  header_offset: int, header_length: int, header_checksum: int, file_length: int,
                  reserved: int = 0, preamble_checksum: int | None = None) -> bytes:
    """The 64 preamble bytes; the preamble checksum is computed unless given (tests forge bad ones)."""
    body = C.PREAMBLE_STRUCT.pack(C.MAGIC, major, minor, flags, header_offset, header_length,
                                  header_checksum, file_length, reserved, 0)[: C.PREAMBLE_CHECKED]
    if preamble_checksum is None:
        preamble_checksum = checksum(body)
    return body + preamble_checksum.to_bytes(8, "little")


def _magic_hint(head: bytes) -> str:
    if head.startswith(b"\x89RVQ\n") or head.startswith(b"\x89RVQ\r\x1a"):
        return " (looks like CR LF was converted to LF: the file went through a text-mode transfer)"
    if head.startswith(b"\x89RVQ\r\r\n") or head.startswith(b"\x89RVQ\r\n\x1a\r\n"):
        return " (looks like LF was converted to CR LF: the file went through a text-mode transfer)"
    if head[:1] == b"\x09" and head[1:4] == b"RVQ":
        return " (the high bit of the first byte was lost: a 7-bit transfer)"
    return ""


def parse_preamble(head: bytes, actual_length: int, path=None) -> Preamble:
    """Validate the preamble. ``head`` is the file's first min(64, size) bytes; ``actual_length`` its size."""
    n = len(head)
    # P1, P2: magic, with the special case of a file shorter than the magic
    if n < len(C.MAGIC):
        if C.MAGIC.startswith(head):
            raise TruncatedFileError(path, f"file is {actual_length} bytes, too short for the {C.PREAMBLE_SIZE}-byte preamble")
        raise BadMagicError(path, f"not an .rvq file (starts with {head.hex()})")
    if head[:8] != C.MAGIC:
        raise BadMagicError(path, f"not an .rvq file: bad signature {head[:8].hex()} "
                                  f"(expected {C.MAGIC.hex()}){_magic_hint(head)}")
    # P3: major version (bytes 8..9 keep this meaning in every version of the format)
    if n < 10:
        raise TruncatedFileError(path, f"file is {actual_length} bytes, too short for the {C.PREAMBLE_SIZE}-byte preamble")
    major = int.from_bytes(head[8:10], "little")
    if major != C.FORMAT_MAJOR:
        raise UnsupportedVersionError(path, f"format major version {major} is not supported (this reader reads "
                                            f"version {C.FORMAT_MAJOR}.x)")
    # P4: the whole preamble
    if n < C.PREAMBLE_SIZE:
        raise TruncatedFileError(path, f"file is {actual_length} bytes, too short for the {C.PREAMBLE_SIZE}-byte preamble")
    (_, major, minor, flags, h_off, h_len, h_ck, f_len, reserved, p_ck) = C.PREAMBLE_STRUCT.unpack(head[: C.PREAMBLE_SIZE])
    # P5: preamble checksum
    got = checksum(head[: C.PREAMBLE_CHECKED])
    if got != p_ck:
        raise ChecksumMismatchError(path, f"preamble checksum mismatch (stored {p_ck:#018x}, computed {got:#018x})")
    # P6: flags
    unknown = flags & ~C.KNOWN_FLAGS
    if unknown:
        raise UnknownFeatureError(path, f"preamble sets flag bits {unknown:#010x} that this reader does not implement")
    # P7: file length against the bytes present
    if f_len > C.MAX_FILE_LENGTH:
        raise LimitExceededError(path, f"declared file length {f_len} exceeds the limit {C.MAX_FILE_LENGTH}")
    if actual_length < f_len:
        raise TruncatedFileError(path, f"file is truncated: {actual_length} bytes present, {f_len} declared")
    if actual_length > f_len:
        raise TrailingDataError(path, f"{actual_length - f_len} unexpected bytes after the declared end of file at {f_len}")
    # P8: header extent
    if h_len > C.MAX_HEADER_LENGTH:
        raise LimitExceededError(path, f"header length {h_len} exceeds the limit {C.MAX_HEADER_LENGTH}")
    if h_len == 0:
        raise MalformedHeaderError(path, "header length is 0")
    if h_off < C.PREAMBLE_SIZE or h_off % C.ALIGNMENT:
        raise LayoutError(path, f"header offset {h_off} is not a multiple of {C.ALIGNMENT} at or after {C.PREAMBLE_SIZE}")
    if h_off + h_len > f_len:
        raise TruncatedFileError(path, f"header [{h_off}, {h_off + h_len}) extends past the end of the file at {f_len}")
    if h_off + h_len < f_len:
        raise LayoutError(path, f"header [{h_off}, {h_off + h_len}) must end the file, but the file ends at {f_len}")
    return Preamble(major, minor, flags, h_off, h_len, h_ck, f_len, reserved, p_ck)


def check_header_checksum(pre: Preamble, header_bytes, path=None) -> None:
    """P9: the header bytes against the preamble's header checksum."""
    got = checksum(header_bytes)
    if got != pre.header_checksum:
        raise ChecksumMismatchError(path, f"header checksum mismatch (stored {pre.header_checksum:#018x}, "
                                          f"computed {got:#018x})")
