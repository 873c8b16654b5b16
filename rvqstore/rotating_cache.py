"""RVQRotatingKVCache: a sliding-window KV cache (mlx-lm ``RotatingKVCache`` semantics) holding codes.

Only the window is kept: the ``keep`` first tokens of the sequence (attention sinks) and the most
recent ones, at most ``max_size`` in all, as TurboQuant-RVQ codes. What attention sees follows mlx-lm:

- before an update the held tokens are cut to ``keep`` sinks + the latest ``max_size - 1 - keep``
  (mlx-lm's ``trim_size = idx - max_size + 1``), then the new tokens are appended, so a chunk of
  ``S`` tokens attends over ``min(offset, max_size - 1) + S`` keys, masked by :meth:`make_mask`
  exactly as mlx-lm masks them;
- after the update the held tokens are cut to ``max_size`` (what the next update can still use), so
  memory never exceeds a window's worth of codes, even after a long one-shot prefill.

Unlike mlx-lm's ring the tokens are always held in temporal order (sinks first): single-token
updates see the same set of keys (their mask is order-free, or built here for temporal order), the
state needs no write index, and a snapshot stores it as is.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import cache_modes
from .cache import _Stream, check_update, trim_count
from .cache_modes import cut as _cut
from .codec import DEFAULT_BITS, EncodedVectors, RVQCodec, _parse_bits, checked_step
from .errors import CodecConfigError, InputShapeError


class RVQRotatingKVCache:
    """Sliding-window cache of RVQ codes, usable wherever mlx-lm takes a ``RotatingKVCache``.

    Args:
        max_size: window capacity in tokens, sinks included (mlx-lm's ``max_size``), >= 1.
        keep: tokens at the start of the sequence that never leave the window, ``0 <= keep < max_size``.
        bits, seed, residual: codec settings (see :class:`rvqstore.RVQCodec`).
        mode: ``"packed"`` (codes only; each update decodes the window) or ``"resident"`` (a decoded
            copy of the window is kept alongside the codes, so each token is decoded once; both are
            classes of :mod:`rvqstore.cache_modes`).
        use_kernels: use the fused GPU kernels where available.
        step: None (Lloyd–Max tables) or the spacing of a uniform grid (:class:`rvqstore.RVQCodec`'s
            ``step``). One codec codes keys and values here: a ``value_step`` other than ``step`` is
            refused (CodecConfigError) rather than dropped.
    """

    def __init__(self, max_size: int, keep: int = 0, bits: tuple[int, int] | int = DEFAULT_BITS, seed: int = 0,
                 residual: str = "conditional", *, mode: str = "packed", use_kernels: bool = True,
                 step: float | None = None, value_step: float | None = None):
        for name, v, lo in (("max_size", max_size, 1), ("keep", keep, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise CodecConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        if keep >= max_size:
            raise CodecConfigError(f"keep ({keep}) must be smaller than max_size ({max_size})")
        mode_impl = cache_modes.for_window(mode)  # refuses an unknown mode
        if value_step is not None and value_step != step:
            raise CodecConfigError(f"a sliding-window cache codes keys and values with one codec: value_step "
                                   f"{value_step!r} differs from step {step!r}")
        self.step = checked_step(bits, seed, residual, step)  # validate the codec settings now
        self.max_size = max_size
        self.keep = keep
        self.codec_bits = _parse_bits(bits)
        self.seed = seed
        self.residual = residual
        self._mode = mode_impl
        self.use_kernels = use_kernels
        self.offset = 0  # tokens seen (absolute position of the next token)
        self._keys: _Stream | None = None
        self._values: _Stream | None = None
        self.dtype: mx.Dtype | None = None
        self.geometry: tuple[int, int, int, int] | None = None  # (B, H, Dk, Dv)

    # ---- helpers ----------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``"packed"`` or ``"resident"``: the mode object's name (rvqstore.cache_modes)."""
        return self._mode.name

    @property
    def n_held(self) -> int:
        """Tokens held in the window (sinks included)."""
        return 0 if self._keys is None else self._keys.n

    def _codec(self, dim: int) -> RVQCodec:
        return RVQCodec(dim, self.codec_bits, self.seed, self.residual, use_kernels=self.use_kernels, step=self.step)

    def _init_geometry(self, keys: mx.array, values: mx.array) -> None:
        geo = check_update(keys, values, self.geometry)  # every check before any state changes
        if self.geometry is None:
            kc, vc = self._codec(geo[2]), self._codec(geo[3])  # may refuse the head dim: state untouched
            self.geometry, self.dtype = geo, keys.dtype
            self._keys, self._values = _Stream(kc, geo[:2]), _Stream(vc, geo[:2])

    def _limit(self, n: int) -> None:
        """Cut the held tokens to ``keep`` sinks + the latest ``n - keep``, into buffers of exactly that size
        (no-op when n or fewer are held in buffers of at most n: _Stream grows in steps of 256 tokens,
        more than a small window)."""
        held = self.n_held
        if held == 0 or (held <= n and self._keys.scales.shape[-1] <= n):
            return
        keep = min(self.keep, held)
        tail = min(held, n) - keep
        for s in (self._keys, self._values):
            sc, c1, c2 = s.used()
            s.set_packed(_cut(sc, keep, tail), _cut(c1, keep, tail), None if c2 is None else _cut(c2, keep, tail))
        self._mode.cut(keep, tail)  # resident: the decoded window with the codes

    def _encode(self, keys: mx.array, values: mx.array) -> None:
        # one codec call for both sides where they code alike (a file may give them different tables)
        if self.geometry[2] == self.geometry[3] and self._keys.codec.same_code(self._values.codec):
            b = keys.shape[0]
            enc = self._keys.codec.encode(mx.concatenate([keys, values.astype(keys.dtype)], axis=0),
                                          check_finite=False)
            for s, sl in ((self._keys, slice(0, b)), (self._values, slice(b, 2 * b))):
                s.append_encoded(EncodedVectors(enc.scales[sl], enc.codes1[sl],
                                                None if enc.codes2 is None else enc.codes2[sl], enc.dtype))
        else:
            self._keys.append(keys)
            self._values.append(values)

    def _decode_range(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        return self._keys.decode(start, end, self.dtype), self._values.decode(start, end, self.dtype)

    # ---- the mlx-lm protocol ------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` (B, H, S, D); return the window attention sees (temporal order)."""
        self._init_geometry(keys, values)
        self._limit(self.max_size - 1)
        start = self.n_held
        self._encode(keys, values)
        self.offset += keys.shape[2]
        self._mode.extend(self, start)  # resident: the new tokens decoded into the copy
        out = self._mode.coded(self, self.n_held)  # packed: the window decoded; resident: the copy
        self._limit(self.max_size)
        return out

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The decoded keys and values of the window (temporal order)."""
        if self.n_held == 0:
            raise InputShapeError("the cache is empty")
        return self._mode.coded(self, self.n_held)

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def empty(self) -> bool:
        return self.geometry is None

    def trimmable_to(self) -> int:
        """Smallest offset this cache can be trimmed back to with the same future results.

        The next update attends over ``keep`` sinks + the ``max_size - 1 - keep`` tokens before it:
        trimming back to ``p`` is exact while the window still holds all of them.
        """
        dropped_end = self.offset - (self.n_held - min(self.keep, self.n_held))  # first recent position held
        if self.n_held >= self.offset:  # nothing ever left the window
            return 0
        return dropped_end + (self.max_size - 1 - self.keep)

    def is_trimmable(self) -> bool:
        return self.trimmable_to() < self.offset

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens, as far as :meth:`trimmable_to` allows; returns how many were dropped."""
        n = max(0, min(trim_count(n), self.offset - self.trimmable_to()))
        if n == 0:
            return 0
        held = self.n_held - n
        for s in (self._keys, self._values):
            s.n = held
            sc, c1, c2 = s.used()
            s.set_packed(sc, c1, c2)
        self._mode.truncate(held)
        self.offset -= n
        return n

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        """The mask mlx-lm's RotatingKVCache makes, for this cache's temporal order."""
        from mlx_lm.models.base import create_causal_mask

        if n > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + n > window_size or return_array:
                return create_causal_mask(n, offset, window_size=window_size)
            return "causal"
        if window_size is None:
            return None
        if self.offset >= window_size and self.max_size > window_size:
            size = self.offset + 1 if self.offset < self.max_size else self.max_size
            return mx.arange(size) >= (size - window_size)
        return None

    @property
    def nbytes(self) -> int:
        """Bytes held: codes and scales (allocated capacity), and the resident decoded window."""
        return sum(s.nbytes for s in (self._keys, self._values) if s is not None) + self._mode.nbytes

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the used codes and scales: what a snapshot of this cache stores."""
        if self.geometry is None:
            return 0
        return sum(a.nbytes for s in (self._keys, self._values) for a in s.used() if a is not None)

    # ---- state ------------------------------------------------------------------------------------
    @property
    def state(self) -> tuple:
        """Arrays held: (k_scales, k_codes1, k_codes2, v_scales, v_codes1, v_codes2)."""
        if self.geometry is None:
            return ()
        return (*self._keys.used(), *self._values.used())

    @property
    def meta_state(self) -> tuple[str, ...]:
        b1, b2 = self.codec_bits
        dt = "" if self.dtype is None else str(self.dtype).split(".")[-1]
        return (str(b1), str(b2), str(self.seed), self.residual, self.mode, str(self.max_size), str(self.keep),
                str(self.offset), dt)

    @classmethod
    def from_packed(cls, *, keys: tuple[mx.array, mx.array, mx.array | None],
                    values: tuple[mx.array, mx.array, mx.array | None], offset: int, dtype: mx.Dtype,
                    head_dims: tuple[int, int], key_codec: RVQCodec | None = None,
                    value_codec: RVQCodec | None = None, check_scales: bool = True,
                    **kwargs: Any) -> "RVQRotatingKVCache":
        """Build from the packed window (temporal order: sinks, then the latest tokens) and the offset
        (``check_scales``: as :meth:`RVQKVCache.from_packed`)."""
        c = cls(**kwargs)
        ks = keys[0] if isinstance(keys, (tuple, list)) and keys else None
        if not isinstance(ks, mx.array) or ks.ndim != 3:
            raise InputShapeError("keys must be (scales, codes1, codes2) with scales of shape (B, heads, tokens)")
        b, h, n = ks.shape
        if n > c.max_size or n > offset or (offset > n and n < min(c.keep, offset)):
            raise InputShapeError(f"a window of {n} tokens does not fit max_size {c.max_size}, keep {c.keep}, "
                                  f"offset {offset}")
        c.geometry, c.dtype = (b, h, head_dims[0], head_dims[1]), dtype
        c._keys = _Stream(key_codec or c._codec(head_dims[0]), (b, h))
        c._values = _Stream(value_codec or c._codec(head_dims[1]), (b, h))
        c.step = c._keys.codec.step  # the codecs' tables rule (a file's)
        for stream, packed, d in ((c._keys, keys, head_dims[0]), (c._values, values, head_dims[1])):
            stream.check_packed(packed, (b, h, n), d, dtype, head_dims, scales=check_scales)
        c._keys.set_packed(*keys)
        c._values.set_packed(*values)
        c.offset = offset
        c._mode.extend(c, 0)  # resident: decode the loaded window into the copy
        return c

    @classmethod
    def from_rotating_cache(cls, cache: Any, **kwargs: Any) -> "RVQRotatingKVCache":
        """Encode the window of an mlx-lm ``RotatingKVCache`` (same max_size, keep and offset)."""
        c = cls(cache.max_size, cache.keep, **kwargs)
        if cache.keys is None or cache.offset == 0:
            return c
        # mlx-lm's own reordering: its ring (or its over-long buffer after a prefill) in temporal order.
        k, v = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
        held = min(k.shape[2], cache.offset)
        k, v = k[:, :, :held], v[:, :, :held]
        c._init_geometry(k, v)
        c._encode(k, v)
        c.offset = cache.offset
        c._limit(c.max_size)
        c._mode.extend(c, 0)
        return c

    def __repr__(self) -> str:
        grid = "" if self.step is None else f"step={self.step}, "
        return (f"RVQRotatingKVCache(max_size={self.max_size}, keep={self.keep}, bits={self.codec_bits}, {grid}"
                f"mode={self.mode!r}, offset={self.offset}, held={self.n_held}, nbytes={self.nbytes})")
