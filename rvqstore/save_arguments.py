"""The caller-supplied parts of a snapshot (token ids, metadata), checked once with typed errors.

Everything here runs before a file is touched, so a refused save leaves any existing file as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import InvalidArgumentError

MAX_TOKEN_ID = 2**31 - 1  # token ids are stored as int32


def parse_token_ids(tokens: Any) -> np.ndarray:
    """A flat sequence of token ids (ints, numpy or mlx integers) as int64, each in [0, 2^31)."""
    if isinstance(tokens, (str, bytes, Mapping)):
        raise InvalidArgumentError(f"tokens must be a sequence of integer ids, got {type(tokens).__name__}")
    if isinstance(tokens, mx.array):
        tokens = np.array(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not (tokens.dtype.kind in "iu" or tokens.size == 0):
            raise InvalidArgumentError(f"tokens must be a flat array of integer ids, got {tokens.dtype} "
                                       f"of shape {tokens.shape}")
        ids = tokens.astype(np.int64) if tokens.dtype != np.uint64 else tokens
    else:
        try:
            items = list(tokens)
        except TypeError:
            raise InvalidArgumentError(f"tokens must be a sequence of integer ids, got {type(tokens).__name__}") from None
        bad = next((t for t in items if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
        if bad is not None:
            raise InvalidArgumentError(f"token ids must be integers, got {bad!r} ({type(bad).__name__})")
        out_of_range = next((t for t in items if not 0 <= int(t) <= MAX_TOKEN_ID), None)
        if out_of_range is not None:
            raise InvalidArgumentError(f"token ids must be in [0, 2^31), got {int(out_of_range)}")
        return np.array([int(t) for t in items], dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > MAX_TOKEN_ID):
        raise InvalidArgumentError(f"token ids must be in [0, 2^31), got values in [{int(ids.min())}, "
                                   f"{int(ids.max())}]")
    return ids.astype(np.int64)


def parse_metadata(metadata: Any) -> dict[str, str]:
    """``None`` or a mapping of str to str, as a plain dict."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError(f"metadata must map str to str, got {type(metadata).__name__}")
    bad = next(((k, v) for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)), None)
    if bad is not None:
        raise InvalidArgumentError(f"metadata must map str to str, got {bad[0]!r}: {bad[1]!r}")
    return dict(metadata)
