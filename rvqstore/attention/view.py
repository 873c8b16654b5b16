"""What attention on codes reads from a cache: the two packed streams and the full-precision window.

A :class:`CodesView` is a read-only snapshot of one :class:`rvqstore.cache.RVQKVCache` (taken after
its ``update_and_fetch``): the streams' preallocated buffers with the count of coded tokens, and the
window's arrays. Kernels take the whole buffers (contiguous, so no copy per step); MLX-ops paths take
the used slices.
"""

from __future__ import annotations

import mlx.core as mx

from ..codec import RVQCodec
from .launch_args import shared_count


class CodesView:
    """Read-only by convention (a plain class with slots: made once per layer and step, so its
    construction is kept cheap; a frozen dataclass costs three times as much to build)."""

    __slots__ = ("key_codec", "value_codec", "n_kv_heads", "n_coded", "key_buffers", "value_buffers",
                 "dense_keys", "dense_values", "n_dense", "count")

    def __init__(self, key_codec: RVQCodec, value_codec: RVQCodec, n_kv_heads: int, n_coded: int,
                 key_buffers: tuple, value_buffers: tuple, dense_keys: mx.array | None,
                 dense_values: mx.array | None, count: mx.array | None = None):
        self.key_codec = key_codec
        self.value_codec = value_codec
        self.n_kv_heads = n_kv_heads
        self.n_coded = n_coded
        self.key_buffers = key_buffers  # (scales (B, H, cap) bf16, codes1 (B, H, cap, W1), codes2 or None)
        self.value_buffers = value_buffers
        self.dense_keys = dense_keys  # (B, H, n_dense, Dk) or None
        self.dense_values = dense_values
        self.n_dense = 0 if dense_keys is None else int(dense_keys.shape[2])  # read on every call: kept
        # [n_coded] from a pending in-place write (rvqstore.cache._Stream.live): kernels take it as their
        # count, which orders them after the write; anything else reads the buffers after settle()
        self.count = count

    def count_array(self) -> mx.array:
        """``[n_coded]`` for a kernel: the pending write's count, else one shared array per value."""
        return shared_count(self.n_coded) if self.count is None else self.count

    def settle(self) -> None:
        """Finish a pending in-place write before MLX ops read the buffers (they cannot be ordered after it)."""
        if self.count is not None:
            mx.eval(self.count)
            self.count = None

    @property
    def n_total(self) -> int:
        return self.n_coded + self.n_dense

    def _rotated(self, codec: RVQCodec, buffers: tuple) -> tuple[mx.array, mx.array]:
        self.settle()
        n = self.n_coded
        s, c1, c2 = buffers
        y = codec.dequantize(c1[:, :, :n], None if c2 is None else c2[:, :, :n])
        return y, s[:, :, :n].astype(mx.float32)

    def rotated_keys(self) -> tuple[mx.array, mx.array]:
        """``(y_k, s_k)``: rotated-domain key rows ``(B, H, n, Dk)`` float32 and their norms ``(B, H, n)``."""
        return self._rotated(self.key_codec, self.key_buffers)

    def rotated_values(self) -> tuple[mx.array, mx.array]:
        return self._rotated(self.value_codec, self.value_buffers)
