"""Reading the test vectors' expected values: float bit patterns and ulps per dtype (shared by the vector tests)."""

from __future__ import annotations

import numpy as np


def bits_to_float(bits: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values of the bit patterns ``bits`` of ``dtype`` (float32, float16 or bfloat16)."""
    if dtype == "float32":
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    if dtype == "float16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def ulp(x: np.ndarray, dtype: str, formats: dict) -> np.ndarray:
    """The unit in the last place of ``x`` in ``dtype``; ``formats``: make_format_vectors.FORMATS."""
    p, emin, _ = formats[dtype]
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** emin)))
    return 2.0 ** (e - p + 1)
