"""The one checksum of the format: XXH3-64 with seed 0, stored as an unsigned 64-bit integer.

XXH3 is specified in https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md; the check value
for the empty input is ``0x2D06800538D394C2``.
"""

from __future__ import annotations

import xxhash

#: XXH3-64 (seed 0) of the empty input; the spec quotes it as a self-test for implementers.
EMPTY_CHECKSUM = 0x2D06800538D394C2


def checksum(data) -> int:
    """XXH3-64 (seed 0) of a bytes-like object (bytes, memoryview over an mmap, contiguous array)."""
    return xxhash.xxh3_64_intdigest(data)


class Hasher:
    """Incremental XXH3-64 for data fed in pieces (same result as :func:`checksum` of the whole)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data) -> None:
        self._h.update(data)

    def intdigest(self) -> int:
        return self._h.intdigest()
