"""The codec state of an :class:`rvqstore.RVQKVCache`: sink tokens kept in full precision and a per-head key mean.

Two measured wins of the evaluation (docs/codec-state.md): the first token's key has a small norm and
points away from the others, so it is kept exact (a *sink*) instead of coded; and the per-(batch, head)
mean of the keys, which the rotation cannot spread, is subtracted before coding and added back after
decoding. The arithmetic is fixed so that files hold the same thing (format_spec/rvq-v1.md, 1.2):

- positions ``[0, n_sink)`` are the sink, ``n_sink = min(offset, sink_tokens)``; then the coded tokens,
  then the full-precision window;
- the sink and the mean are held in the *state dtype*: bfloat16 for bfloat16 models, else float16; an
  array that is not finite after that cast (a float32 model's |x| > 65504) stays float32;
- the mean is set once, at the first update that codes tokens: the float32 mean over the tokens that
  update codes (axis 2; vectors holding NaN or Inf left out), rounded to the state dtype; it never
  changes afterwards, except that a ``trim`` back to no coded token drops it (a file holds a mean only
  beside coded tokens, so the cache and its saved copy then take the same mean from the next coded
  tokens);
- keys are coded as ``dtype(float32(keys) - float32(mean))`` (the codec's scale bound is the model
  dtype's, so half-precision models round the centered keys to their dtype first; float32 models code
  ``float32(keys) - float32(mean)`` exactly), and a decoded key is ``dtype(float32(dec) + float32(mean))``
  with ``dec`` the codec's decode in the cache's dtype. Values are never centered.

:class:`CodecState` holds the arrays and does each of these steps; the cache calls it at a few points
(an update before coding, decoded keys after decoding, what it hands back, the attention view, trim,
state, from_packed) and holds ``None`` instead when both settings are off, so those caches run exactly
the paths they ran before.

Attention on codes (:mod:`rvqstore.attention`) needs no change: softmax is invariant to a shift that is
the same for every key of a head, so attention over the coded keys *without* the mean and the sink and
window keys *minus* the mean equals attention over the true keys. :meth:`CodecState.attention_window`
joins the sink in front of the window for the view; :meth:`CodecState.attention_mask` puts a mask into
the view's key order ``[coded, sink, window]``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .codec import _FLOAT_DTYPES as _FLOATS
from .errors import CodecConfigError, InputShapeError

#: the largest ``sink_tokens`` a file can hold (format layer key, 0 ..= 2^31 - 1)
MAX_SINK_TOKENS = (1 << 31) - 1


def check_settings(sink_tokens: Any, center_keys: Any) -> None:
    if not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or not 0 <= sink_tokens <= MAX_SINK_TOKENS:
        raise CodecConfigError(f"sink_tokens must be an integer in 0 ..= {MAX_SINK_TOKENS}, got {sink_tokens!r}")
    if not isinstance(center_keys, bool):
        raise CodecConfigError(f"center_keys must be True or False, got {center_keys!r}")


def state_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """The dtype the sink and the mean are held in for a model of ``dtype``."""
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def held(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """``x`` in the state dtype of a model of ``dtype``, or as float32 where that cast is not finite."""
    c = x.astype(state_dtype(dtype))
    if bool(mx.all(mx.isfinite(c)).item()):
        return c
    return x.astype(mx.float32)


def _joined(old: mx.array | None, new: mx.array, dtype: mx.Dtype) -> mx.array:
    """``old`` then ``new`` along axis 2, one array in one dtype (float32 once either part needs it)."""
    part = held(new, dtype)
    if old is None:
        return part
    if part.dtype != old.dtype:
        old, part = old.astype(mx.float32), new.astype(mx.float32)
    return mx.concatenate([old, part], axis=2)


def _finite_mean(keys: mx.array) -> mx.array:
    """The mean over axis 2 of float32 ``keys`` (B, H, T, D); vectors holding NaN or Inf (which code as
    NaN anyway) are left out, so that one bad token cannot spoil every key coded after it (a head
    without a finite vector gets 0: no centering)."""
    mean = mx.mean(keys, axis=2)
    if bool(mx.all(mx.isfinite(mean)).item()):
        return mean
    ok = mx.all(mx.isfinite(keys), axis=-1, keepdims=True)
    total = mx.sum(mx.where(ok, keys, 0.0), axis=2)
    return total / mx.maximum(mx.sum(ok, axis=2), 1).astype(mx.float32)


class CodecState:
    """The sink tokens and the key mean of one cache (see the module docstring)."""

    __slots__ = ("sink_tokens", "center_keys", "sink_keys", "sink_values", "key_mean", "_mean32", "_front")

    def __init__(self, sink_tokens: int, center_keys: bool):
        self.sink_tokens = sink_tokens
        self.center_keys = center_keys
        self.sink_keys: mx.array | None = None  # (B, H, n_sink, Dk) in the state dtype (or float32)
        self.sink_values: mx.array | None = None
        self.key_mean: mx.array | None = None  # (B, H, Dk)
        self._mean32: mx.array | None = None  # key_mean as float32 (B, H, 1, Dk), broadcast over tokens
        self._front: tuple | None = None  # the sink as attention reads it, made once per sink and mean

    @classmethod
    def make(cls, sink_tokens: Any, center_keys: Any) -> "CodecState | None":
        """The state of a cache made with these settings (checked), or None when both are off."""
        check_settings(sink_tokens, center_keys)
        return cls(sink_tokens, center_keys) if sink_tokens or center_keys else None

    @property
    def n_sink(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[2]

    # ---- an update ---------------------------------------------------------------------------------
    def take_sink(self, keys: mx.array, values: mx.array, offset: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Hold the positions of ``keys``/``values`` (the update at ``offset``) that fall in the sink;
        return the rest (possibly no token)."""
        t = keys.shape[2]
        k = min(max(self.sink_tokens - offset, 0), t)
        if k == 0:
            return keys, values
        self.sink_keys = _joined(self.sink_keys, keys[:, :, :k], dtype)
        self.sink_values = _joined(self.sink_values, values[:, :, :k], dtype)
        self._front = None
        return keys[:, :, k:], values[:, :, k:]

    def centered(self, keys: mx.array, dtype: mx.Dtype) -> mx.array:
        """The keys to code: minus the mean (set here from these keys at the first coded update)."""
        if not self.center_keys:
            return keys
        if self.key_mean is None:
            self._set_mean(held(_finite_mean(keys.astype(mx.float32)), dtype))
        out = keys.astype(mx.float32) - self._mean32
        return out if dtype == mx.float32 else out.astype(dtype)

    def _set_mean(self, mean: mx.array | None) -> None:
        self.key_mean = mean
        self._mean32 = None if mean is None else mean.astype(mx.float32)[:, :, None, :]
        self._front = None

    @property
    def mean32(self) -> mx.array | None:
        """The mean as float32 ``(B, H, 1, Dk)`` where keys are centered, else None."""
        return self._mean32

    def restored(self, keys: mx.array, dtype: mx.Dtype) -> mx.array:
        """Decoded keys ``dec`` (in ``dtype``) as the cache hands them out: ``dtype(f32(dec) + f32(mean))``."""
        if self._mean32 is None:
            return keys
        out = keys.astype(mx.float32) + self._mean32
        return out if dtype == mx.float32 else out.astype(dtype)

    # ---- what the cache hands out -------------------------------------------------------------------
    def in_front(self, k: mx.array | None, v: mx.array | None, dtype: mx.Dtype) -> tuple:
        """The sink (cast to ``dtype``) joined in front of the rest of the history ``k``/``v``."""
        if self.sink_keys is None:
            return k, v
        sk, sv = self.sink_keys.astype(dtype), self.sink_values.astype(dtype)
        if k is None:
            return sk, sv
        return mx.concatenate([sk, k], axis=2), mx.concatenate([sv, v], axis=2)

    def attention_window(self, dk: mx.array | None, dv: mx.array | None) -> tuple:
        """The full-precision part of the attention view: the sink, then the window ``dk``/``dv``; keys
        minus the mean when the coded keys are read without it (float32 then)."""
        if self.sink_keys is None:
            return (dk, dv) if dk is None or self._mean32 is None else (dk.astype(mx.float32) - self._mean32, dv)
        if self._front is None:  # every attention path reads this part as float32; fixed once the sink is full
            sk = self.sink_keys.astype(mx.float32)
            self._front = (sk if self._mean32 is None else sk - self._mean32, self.sink_values.astype(mx.float32))
        if dk is None:
            return self._front
        dk = dk.astype(mx.float32)
        if self._mean32 is not None:
            dk = dk - self._mean32
        return (mx.concatenate([self._front[0], dk], axis=2),
                mx.concatenate([self._front[1], dv.astype(mx.float32)], axis=2))

    def attention_mask(self, mask: Any, n_queries: int, n_coded: int, n_window: int) -> Any:
        """``mask`` (None, ``"causal"`` or an array over the true key positions) for the view's key order
        ``[coded, sink, window]``. A causal mask whose queries all sit in the window needs nothing; other
        causal calls with several queries get a boolean array built from the true positions; arrays
        whose last axis spans the keys are permuted (anything else is left to the attention paths'
        checks)."""
        n_sink = self.n_sink
        if mask is None or n_sink == 0 or n_coded == 0:
            return mask
        t = n_sink + n_coded + n_window
        if isinstance(mask, str):
            if mask != "causal" or n_queries == 1 or n_queries <= n_window:
                return mask
            q = mx.arange(t - n_queries, t)[:, None]
            return q >= self._positions(n_coded, t)[None]
        if isinstance(mask, mx.array) and mask.ndim >= 1 and mask.shape[-1] == t:
            return mx.take(mask, self._positions(n_coded, t), axis=-1)
        return mask

    def _positions(self, n_coded: int, t: int) -> mx.array:
        """The true position of each key of the view order ``[coded, sink, window]``."""
        s = self.n_sink
        return mx.concatenate([mx.arange(s, s + n_coded), mx.arange(0, s), mx.arange(s + n_coded, t)])

    # ---- trim, memory, rebuilding --------------------------------------------------------------------
    def trim(self, keep: int, n_coded: int) -> None:
        """The cache keeps its first ``keep`` positions and ``n_coded`` coded tokens."""
        if keep < self.n_sink:
            self.sink_keys = self.sink_keys[:, :, :keep] if keep else None
            self.sink_values = self.sink_values[:, :, :keep] if keep else None
            self._front = None
        if n_coded == 0:
            self._set_mean(None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.sink_keys, self.sink_values, self.key_mean) if a is not None)

    def arrays(self) -> tuple:
        """``(sink_keys, sink_values, key_mean)``, each None where absent."""
        return self.sink_keys, self.sink_values, self.key_mean

    def load(self, sink: Any, key_mean: Any, geometry: tuple[int, int, int, int], n_coded: int,
             n_dense: int) -> int:
        """Take ``sink`` (None or ``(sink_keys, sink_values)``) and ``key_mean`` from outside (a file, a
        caller) after checking them against the cache they rebuild; returns ``n_sink``."""
        b, h, dk, dv = geometry
        n_sink = 0
        if sink is not None:
            if (not isinstance(sink, (tuple, list)) or len(sink) != 2
                    or not all(isinstance(a, mx.array) and a.ndim == 4 for a in sink)):
                raise InputShapeError("sink must be None or (sink_keys, sink_values), arrays (B, heads, S, D)")
            n_sink = sink[0].shape[2]
            for name, a, d in (("sink_keys", sink[0], dk), ("sink_values", sink[1], dv)):
                if a.shape != (b, h, n_sink, d) or a.dtype not in _FLOATS:
                    raise InputShapeError(f"{name} must be float16, bfloat16 or float32 of shape {(b, h, n_sink, d)}, "
                                          f"got {a.dtype} {tuple(a.shape)}")
        offset = n_sink + n_coded + n_dense
        if n_sink != min(offset, self.sink_tokens):
            raise InputShapeError(f"a cache of {offset} tokens with sink_tokens={self.sink_tokens} holds "
                                  f"{min(offset, self.sink_tokens)} sink positions, got {n_sink}")
        want_mean = self.center_keys and n_coded > 0
        if (key_mean is not None) != want_mean:
            raise InputShapeError("key_mean is given exactly when center_keys is set and tokens are coded "
                                  f"(center_keys={self.center_keys}, {n_coded} coded tokens), "
                                  f"got {'an array' if key_mean is not None else 'None'}")
        if key_mean is not None and (not isinstance(key_mean, mx.array) or key_mean.shape != (b, h, dk)
                                     or key_mean.dtype not in _FLOATS):
            raise InputShapeError(f"key_mean must be float16, bfloat16 or float32 of shape {(b, h, dk)}, got "
                                  f"{getattr(key_mean, 'dtype', type(key_mean).__name__)} "
                                  f"{tuple(getattr(key_mean, 'shape', ()))}")
        if key_mean is not None and not bool(mx.all(mx.isfinite(key_mean)).item()):
            raise InputShapeError("key_mean holds NaN or Inf")
        if n_sink:
            self.sink_keys, self.sink_values = sink[0], sink[1]
        self._set_mean(key_mean)  # (and forgets the attention view's sink)
        return n_sink
