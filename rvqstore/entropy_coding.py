"""Entropy-coded index streams (issue 11, item 4): a stand-alone representation of one codec's
stage-1/stage-2 indices for files, which decodes to the packed in-memory layout.

Fixed-width codes waste what the indices do not carry: a Lloyd–Max code of a Gaussian uses its
outer cells less often than its inner ones (2-bit: probabilities 0.16/0.34/0.34/0.16, entropy 1.91
bits). Here each coordinate's joint index ``i1 * 2**bits2 + i2`` (the cell among all thresholds of
the conditional codebook) is coded with rANS against a fixed model: the probabilities of those cells
under N(0, 1), which the rotated, normalized coordinates follow (the codec's own premise), so the
model costs no side information and is the same for every stream of a codec.

Coder: rANS from ``constriction`` (Rust, with Python bindings, on PyPI: a maintained, documented
implementation of exactly this coder; decoding runs in native code, not in Python). rANS rather than
arithmetic coding because its decoder is a table lookup and a multiply per symbol and its state
is a stack of 32-bit words, which a fixed-layout file section stores as is.

Not wired into ``.rvq`` files yet: the format reserves section codec ``"rans"`` (docs/design-format-1.1.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .codec import RVQCodec
from .errors import CodecConfigError, RVQError
from .packing import pack_codes

CODER = "rans (constriction AnsCoder, 32-bit words, 24-bit probabilities)"


class EntropyCodingUnavailableError(RVQError, ImportError):
    """The optional ``constriction`` package is not installed."""


def _constriction():
    try:
        import constriction
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise EntropyCodingUnavailableError("entropy coding needs the optional package 'constriction' "
                                            "(pip install constriction)") from e
    return constriction


def cell_thresholds(codec: RVQCodec) -> np.ndarray:
    """All thresholds of the codec in ascending order: the joint index of a coordinate is the
    number of them it exceeds (for single-stage codes, the stage-1 boundaries)."""
    if codec.bits2 == 0:
        return codec.boundaries1.astype(np.float64)
    if codec.residual != "conditional":
        raise CodecConfigError("entropy coding handles conditional-residual and single-stage codecs")
    return codec._fine_thresholds.astype(np.float64)


def gaussian_model(codec: RVQCodec) -> np.ndarray:
    """Probability of each joint cell under N(0, 1)."""
    t = cell_thresholds(codec)
    cdf = np.array([0.0] + [0.5 * (1 + math.erf(v / math.sqrt(2))) for v in t] + [1.0])
    return np.diff(cdf)


def joint_indices(codec: RVQCodec, x: mx.array) -> tuple[np.ndarray, mx.array]:
    """(joint indices ``(..., dim)`` uint8, bfloat16 norms) of ``x``, identical to the codec's codes."""
    y, scales = codec.rotate(x.astype(mx.float32))
    t = mx.array(cell_thresholds(codec).astype(np.float32))
    idx = mx.sum(y[..., None] > t, axis=-1).astype(mx.uint8)
    return np.array(idx), scales


@dataclass(frozen=True)
class CodedIndices:
    shape: tuple[int, ...]  # (..., dim) of the indices
    words: np.ndarray  # uint32, the rANS stack

    @property
    def nbytes(self) -> int:
        return self.words.nbytes


def encode(codec: RVQCodec, idx: np.ndarray) -> CodedIndices:
    c = _constriction()
    model = c.stream.model.Categorical(gaussian_model(codec), perfect=False)
    enc = c.stream.stack.AnsCoder()
    enc.encode_reverse(np.ascontiguousarray(idx, dtype=np.int32).ravel(), model)
    return CodedIndices(tuple(idx.shape), enc.get_compressed())


def decode(codec: RVQCodec, coded: CodedIndices) -> np.ndarray:
    """The joint indices back (uint8)."""
    c = _constriction()
    n = int(np.prod(coded.shape))
    if coded.shape[-1] != codec.dim or n > 64 * coded.words.size * 32:  # >= 1/64 bit per symbol is impossible
        raise CodecConfigError(f"coded indices of shape {coded.shape} do not fit this codec or their words")
    model = c.stream.model.Categorical(gaussian_model(codec), perfect=False)
    dec = c.stream.stack.AnsCoder(np.ascontiguousarray(coded.words, dtype=np.uint32))
    return dec.decode(model, n).astype(np.uint8).reshape(coded.shape)


def to_packed(codec: RVQCodec, idx: np.ndarray) -> tuple[mx.array, mx.array | None]:
    """Joint indices -> the packed (codes1, codes2) words the cache holds in memory."""
    j = mx.array(idx.astype(np.uint32))
    if codec.bits2 == 0:
        return pack_codes(j, codec.bits1), None
    return pack_codes(j >> codec.bits2, codec.bits1), pack_codes(j & ((1 << codec.bits2) - 1), codec.bits2)
