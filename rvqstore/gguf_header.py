"""A small GGUF header reader: metadata and tensor descriptions, no tensor data.

Used to refuse a GGUF the loader cannot handle (architecture, vocabulary, tensor types) with an
:class:`UnsupportedModelError` naming the problem, before ``mx.load`` touches any tensor. Layout
(GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64, metadata count u64, the
metadata key/value pairs, then per tensor: name, n_dims u32, dims u64 x n_dims, ggml type u32, offset u64.
Every count and length is checked against the bytes left in the file, so a damaged header cannot
make the reader allocate more than the file holds.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .errors import UnsupportedModelError

# ggml tensor types (ggml.h), for messages
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 8


class GGUFHeaderError(UnsupportedModelError):
    """The file is not a GGUF this reader can parse (bad magic, version, truncated or inconsistent header)."""


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, f"type {self.ggml_type}")


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[GGUFTensorInfo] = field(default_factory=list)


class _Reader:
    def __init__(self, f: BinaryIO, size: int, path: str):
        self.f, self.left, self.path = f, size, path

    def take(self, n: int) -> bytes:
        if n < 0 or n > self.left:
            raise GGUFHeaderError(f"{self.path}: GGUF header is truncated or inconsistent")
        b = self.f.read(n)
        if len(b) != n:
            raise GGUFHeaderError(f"{self.path}: GGUF header is truncated")
        self.left -= n
        return b

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY and depth == 0:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if n > self.left:  # every element takes at least one byte
                raise GGUFHeaderError(f"{self.path}: GGUF array of {n} elements is longer than the file")
            return [self.value(etype, depth + 1) for _ in range(n)]
        raise GGUFHeaderError(f"{self.path}: unknown GGUF metadata value type {vtype}")


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Metadata and tensor descriptions of a GGUF file (v2 or v3), without reading tensor data."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        r = _Reader(f, size, path)
        if r.take(4) != b"GGUF":
            raise GGUFHeaderError(f"{path}: not a GGUF file (bad magic)")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise GGUFHeaderError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        if n_tensors > size or n_kv > size:
            raise GGUFHeaderError(f"{path}: GGUF counts ({n_tensors} tensors, {n_kv} keys) exceed the file size")
        h = GGUFHeader(version)
        for _ in range(n_kv):
            key = r.string()
            h.metadata[key] = r.value(r.unpack("<I"))
        for _ in range(n_tensors):
            name = r.string()
            nd = r.unpack("<I")
            if nd > MAX_DIMS:
                raise GGUFHeaderError(f"{path}: tensor {name!r} has {nd} dims")
            shape = tuple(r.unpack("<Q") for _ in range(nd))
            ttype = r.unpack("<I")
            r.unpack("<Q")  # data offset
            h.tensors.append(GGUFTensorInfo(name, shape, ttype))
    return h
