"""What attention on codes reads from a cache: the two packed streams and the full-precision window.

A :class:`CodesView` is a read-only snapshot of one :class:`rvqstore.cache.RVQKVCache` (taken after
its ``update_and_fetch``): the streams' preallocated buffers with the count of coded tokens, and the
window's arrays. Kernels take the whole buffers (contiguous, so no copy per step); MLX-ops paths take
the used slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..codec import RVQCodec


@dataclass(frozen=True)
class CodesView:
    key_codec: RVQCodec
    value_codec: RVQCodec
    n_kv_heads: int
    n_coded: int
    key_buffers: tuple  # (scales (B, H, cap) bf16, codes1 (B, H, cap, W1), codes2 or None)
    value_buffers: tuple
    dense_keys: mx.array | None  # (B, H, n_dense, Dk) or None
    dense_values: mx.array | None

    @property
    def n_dense(self) -> int:
        return 0 if self.dense_keys is None else int(self.dense_keys.shape[2])

    @property
    def n_total(self) -> int:
        return self.n_coded + self.n_dense

    def _rotated(self, codec: RVQCodec, buffers: tuple) -> tuple[mx.array, mx.array]:
        n = self.n_coded
        s, c1, c2 = buffers
        y = codec.dequantize(c1[:, :, :n], None if c2 is None else c2[:, :, :n])
        return y, s[:, :, :n].astype(mx.float32)

    def rotated_keys(self) -> tuple[mx.array, mx.array]:
        """``(y_k, s_k)``: rotated-domain key rows ``(B, H, n, Dk)`` float32 and their norms ``(B, H, n)``."""
        return self._rotated(self.key_codec, self.key_buffers)

    def rotated_values(self) -> tuple[mx.array, mx.array]:
        return self._rotated(self.value_codec, self.value_buffers)
