"""RVQKVCache: an mlx-lm compatible KV cache that keeps keys and values as TurboQuant-RVQ codes.

Modes (each a class of :mod:`rvqstore.cache_modes`, which the cache calls where they differ):
- ``"packed"``: only codes and scales are held (plus the optional full-precision window). Each
  ``update_and_fetch`` encodes the new tokens once and decodes the whole coded history; the least
  memory, the most work per generated token.
- ``"resident"``: codes are still the cache's state (what is saved), and a decoded copy in the
  model's dtype is kept and extended as tokens are coded, so each step decodes only new tokens;
  fast generation at the memory cost of a plain KVCache on top of the codes.

On a CUDA device a decode step's encode is one launch (:mod:`rvqstore.cache_append`: packed caches up
to ``COPY_MAX_TOKENS`` take whole new buffers from it, longer ones write the new codes with static
slice updates, resident caches stage their codes and write them in blocks), and what packed mode
hands back from ``update_and_fetch`` is one launch too (:mod:`rvqstore.cache_fetch`); elsewhere the
compiled step paths of :mod:`rvqstore.cache_steps` serve (docs/attention.md, "The decode step on a GPU").

The attribute name ``bits`` is deliberately absent: mlx-lm switches attention to its affine
quantized path for any cache that has it.
"""

from __future__ import annotations

import operator
import sys
import weakref
from typing import Any

import mlx.core as mx

from . import attention, cache_modes, cache_state, cache_steps, decode_step
from .codec import _FLOAT_DTYPES, DEFAULT_BITS, DTYPE_BY_NAME, EncodedVectors, RVQCodec, _parse_bits, checked_step
from .errors import CodecConfigError, InputShapeError, InvalidArgumentError

MODES = cache_modes.MODES  # importable from here as before

#: what :attr:`RVQKVCache.meta_state` holds, in order (the first nine for every cache, all for a cache
#: with codec state: :meth:`RVQKVCache.from_state` rebuilds it from them)
META_FIELDS = ("bits1", "bits2", "seed", "residual", "mode", "dense_window", "flush_block", "offset", "dtype",
               "sink_tokens", "center_keys", "value_bits1", "value_bits2", "step", "value_step", "key_head_dim",
               "value_head_dim")


def _opt_float(s: str) -> float | None:
    return None if s == "None" else float(s)


def check_update(keys: Any, values: Any, geometry: tuple[int, int, int, int] | None) -> tuple[int, int, int, int]:
    """``(B, H, Dk, Dv)`` of an update after checking types, dtypes and shapes (and, when the cache
    already holds a geometry, that it matches). Caches call it before changing any state."""
    for name, a in (("keys", keys), ("values", values)):
        if not isinstance(a, mx.array):
            raise InputShapeError(f"{name} must be an mx.array, got {type(a).__name__}")
        if a.dtype not in _FLOAT_DTYPES:
            raise InputShapeError(f"{name} must be float16, bfloat16 or float32, got {a.dtype}")
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise InputShapeError(f"keys/values must be (B, n_kv_heads, T, head_dim) with matching B, heads, T; "
                              f"got {tuple(keys.shape)} and {tuple(values.shape)}")
    b, h, _, dk = keys.shape
    geo = (b, h, dk, values.shape[-1])
    if geometry is not None and geo != geometry:
        raise InputShapeError(f"this cache holds (B, heads, Dk, Dv) = {geometry}, got {geo}")
    if b < 1 or h < 1:
        raise InputShapeError(f"keys/values need B >= 1 and n_kv_heads >= 1, got {tuple(keys.shape)}")
    return geo


def trim_count(n: Any) -> int:
    """``trim``'s argument as an int: any integer (numpy's too), not a bool, float or string."""
    if isinstance(n, bool):
        raise InvalidArgumentError(f"trim takes a token count, got {n!r}")
    try:
        return operator.index(n)
    except TypeError:
        raise InvalidArgumentError(f"trim takes an integer token count, got {n!r}") from None


class _Stream:
    """Growable packed storage for one of keys/values of one layer: scales, codes1, codes2.

    Codes of single decode steps can be *staged* (:meth:`stage`): kept aside and written into the
    buffers together, up to :attr:`block` steps in one update per buffer, or as soon as anything
    reads the buffers (``scales``/``codes1``/``codes2`` are properties that write what is staged
    first; ``n`` counts staged tokens). Resident caches stage: their attention reads the decoded
    copy, so a decode step's six small buffer updates become one per :attr:`block` steps.

    Packed caches on CUDA write a step's codes *in place* (:meth:`inplace_ok`, :meth:`wrote_inplace`,
    :func:`rvqstore.cache_append.launch_inplace`): the kernel writes into buffers MLX believes
    unchanged, so two rules keep that invisible. Readers are ordered after the writes through the
    count array the write returns (:meth:`live`: the kernels that read the buffers take it as their
    token count), and every other access evaluates it first (the properties, :meth:`buffers`). And a
    position is written in place only if no array handed out before could read it: at or above
    ``_hw``, the end of everything ever written into these buffers (a trim lowers ``n``, not ``_hw``;
    new buffers reset it)."""

    step = 256
    block = 16

    def __init__(self, codec: RVQCodec, lead: tuple[int, int]):
        self.codec = codec
        self.lead = lead  # (B, H)
        self._scales: mx.array | None = None
        self._codes1: mx.array | None = None
        self._codes2: mx.array | None = None
        self._n = 0  # tokens written into the buffers
        self._staged: list = []  # [(scales, codes1, codes2)] of single steps, in order
        self._staged_n = 0
        self._hw = 0  # positions [0, _hw) were written (and maybe read): never rewritten in place
        self._count = None  # [n] from the last in-place write, until evaluated (see the class docstring)

    # the buffers: reading or replacing one writes the staged steps first
    @property
    def scales(self) -> mx.array | None:
        if self._staged or self._count is not None:
            self._flush()
        return self._scales

    @scales.setter
    def scales(self, a: mx.array | None) -> None:
        self._flush()
        self._scales = a

    @property
    def codes1(self) -> mx.array | None:
        if self._staged or self._count is not None:
            self._flush()
        return self._codes1

    @codes1.setter
    def codes1(self, a: mx.array | None) -> None:
        self._flush()
        self._codes1 = a

    @property
    def codes2(self) -> mx.array | None:
        if self._staged or self._count is not None:
            self._flush()
        return self._codes2

    @codes2.setter
    def codes2(self, a: mx.array | None) -> None:
        self._flush()
        self._codes2 = a

    @property
    def n(self) -> int:
        return self._n + self._staged_n

    def buffers(self) -> tuple[mx.array | None, mx.array | None, mx.array | None]:
        """``(scales, codes1, codes2)`` with what is staged written: the three properties in one call."""
        if self._staged or self._count is not None:
            self._flush()
        return self._scales, self._codes1, self._codes2

    def live(self) -> tuple[tuple, mx.array | None]:
        """``((scales, codes1, codes2), count)`` for a kernel that reads the buffers: ``count`` ``[n]`` is
        the last in-place write's (the kernel must take it as its token count: that orders it after the
        write), or None when nothing is pending (the kernel takes any ``[n]`` then). Nothing is staged in
        the modes that write in place."""
        if self._staged:
            self._flush()
        return (self._scales, self._codes1, self._codes2), self._count

    def settle(self) -> None:
        """Finish a pending in-place write (after it, the buffers' memory holds it for any reader)."""
        if self._count is not None:
            mx.eval(self._count)
            self._count = None

    def inplace_ok(self, t: int) -> bool:
        """Whether ``t`` new tokens can be written in place after the staged ones (which :meth:`live` writes
        first): room in the buffers, and nothing handed out before can read their positions."""
        n = self._n + self._staged_n
        return self._scales is not None and n >= self._hw and n + t <= self._scales.shape[-1]

    def wrote_inplace(self, t: int, count: mx.array) -> None:
        """Record an in-place write of ``t`` tokens whose readers must take ``count``."""
        self._n += t
        self._hw = self._n
        self._count = count

    @n.setter
    def n(self, value: int) -> None:
        self._flush()
        self._n = value

    def stage(self, scales: mx.array, codes1: mx.array, codes2: mx.array | None) -> None:
        """Append one step's codes ``(B, H, t[, W])`` without writing the buffers yet."""
        self._staged.append((scales, codes1, codes2))
        self._staged_n += scales.shape[2]
        if len(self._staged) >= self.block:
            self._flush()

    def _flush(self) -> None:
        self.settle()
        if not self._staged:
            return
        parts, t = self._staged, self._staged_n
        self._staged, self._staged_n = [], 0
        n = self._n
        self._grow(self.lead, n + t)

        def joined(i):
            return parts[0][i] if len(parts) == 1 else mx.concatenate([p[i] for p in parts], axis=2)

        self._scales[:, :, n:n + t] = joined(0)
        self._codes1[:, :, n:n + t] = joined(1)
        if self._codes2 is not None:
            self._codes2[:, :, n:n + t] = joined(2)
        self._n = n + t
        self._hw = max(self._hw, self._n)

    def _grow(self, lead: tuple[int, int], need: int) -> None:
        cap = 0 if self._scales is None else self._scales.shape[-1]
        if need <= cap:
            return
        new_cap = -(-need // self.step) * self.step
        self.settle()  # the copy below reads the buffers with MLX ops
        c = self.codec
        n = self._n  # written tokens (staged ones are written after growing)

        def grow(a, tail, dtype):
            fresh = mx.zeros(lead + (new_cap,) + tail, dtype)
            if a is not None and n:
                fresh[:, :, :n] = a[:, :, :n]
            return fresh

        self._scales = grow(self._scales, (), mx.bfloat16)
        self._codes1 = grow(self._codes1, (c.words1,), mx.uint32)
        if c.bits2:
            self._codes2 = grow(self._codes2, (c.words2,), mx.uint32)
        self._hw = n  # new buffers: nothing past the copied tokens was ever handed out

    def append(self, x: mx.array) -> None:
        self.append_encoded(self.codec.encode(x, check_finite=False))

    def append_encoded(self, enc) -> None:
        lead, t = tuple(enc.scales.shape[:2]), enc.scales.shape[2]
        if t == 0:
            return
        self._flush()
        self._grow(lead, self.n + t)
        end = self.n + t
        self.scales[..., self.n:end] = enc.scales
        self.codes1[..., self.n:end, :] = enc.codes1
        if enc.codes2 is not None:
            self.codes2[..., self.n:end, :] = enc.codes2
        self.n = end
        self._hw = max(self._hw, end)

    def take_buffers(self, scales: mx.array, codes1: mx.array, codes2: mx.array | None, n: int) -> None:
        """Hold new buffers (capacity ``scales.shape[-1]``) whose first ``n`` tokens are coded: the cache's
        own (a kernel's outputs), so the rest may be written in place."""
        self._staged, self._staged_n = [], 0
        self._scales, self._codes1, self._codes2 = scales, codes1, codes2
        self._n = self._hw = n
        self._count = None

    def set_packed(self, scales: mx.array, codes1: mx.array, codes2: mx.array | None) -> None:
        self._staged, self._staged_n = [], 0  # replaced wholesale: nothing staged survives
        self._scales, self._codes1, self._codes2 = scales, codes1, codes2
        self._n = self._hw = scales.shape[-1]  # arrays from outside: never written in place
        self._count = None

    def check_packed(self, packed: Any, shape: tuple[int, int, int], dim: int, dtype: mx.Dtype,
                     head_dims: tuple[int, int], scales: bool = True) -> None:
        """Check ``(scales, codes1, codes2)`` from outside (a file, a caller) before any cache takes them
        (``scales=False``: their values were checked already, by the caller)."""
        if (not isinstance(packed, (tuple, list)) or len(packed) != 3 or not isinstance(packed[0], mx.array)
                or packed[0].shape != shape or self.codec.dim != dim):
            raise InputShapeError(f"keys and values must be (scales, codes1, codes2) with scales of shape "
                                  f"{shape}, coded with head dims {tuple(head_dims)}")
        self.codec.check_encoded(EncodedVectors(*packed, dtype))
        if scales:
            self.codec.check_scales(packed[0], dtype)  # NaN or within the dtype's bound

    def used(self) -> tuple[mx.array, mx.array, mx.array | None]:
        if self.scales is None:  # nothing coded yet (e.g. all tokens still in the dense window)
            return (mx.zeros(self.lead + (0,), mx.bfloat16), mx.zeros(self.lead + (0, self.codec.words1), mx.uint32),
                    mx.zeros(self.lead + (0, self.codec.words2), mx.uint32) if self.codec.bits2 else None)
        n = self.n
        return (self.scales[..., :n], self.codes1[..., :n, :],
                None if self.codes2 is None else self.codes2[..., :n, :])

    def encoded(self, start: int, end: int, dtype: mx.Dtype) -> EncodedVectors:
        scales, codes1, codes2 = self.used() if self.scales is None else (self.scales, self.codes1, self.codes2)
        return EncodedVectors(scales[..., start:end], codes1[..., start:end, :],
                              None if codes2 is None else codes2[..., start:end, :], dtype)

    def decode(self, start: int, end: int, dtype: mx.Dtype) -> mx.array:
        return self.codec.decode(self.encoded(start, end, dtype))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.scales, self.codes1, self.codes2) if a is not None)


class RVQKVCache:
    """KV cache holding TurboQuant-RVQ codes, usable wherever mlx-lm takes a ``KVCache``.

    Args:
        bits: ``(bits1, bits2)`` per stage (see :class:`rvqstore.RVQCodec`).
        seed: rotation seed.
        residual: ``"conditional"`` or ``"shared"`` stage-2 codebooks.
        mode: ``"packed"`` or ``"resident"`` (see the module docstring).
        dense_window: keep up to this many most recent tokens in full precision (0: none). Tokens
            leave the window in blocks of ``flush_block``, so the window holds between
            ``dense_window`` and ``dense_window + flush_block - 1`` tokens once full.
        flush_block: block size for moving tokens from the window into codes.
        use_kernels: use the fused GPU kernels where available.
        value_bits: bits of the values when they differ from the keys' (``bits``); keys are the
            more sensitive side (docs/quality.md), so presets give them more.
        step, value_step: None (Lloyd–Max tables) or the spacing of a uniform grid of
            ``2^(bits1 + bits2)`` points for keys / values (:class:`rvqstore.RVQCodec`'s ``step``);
            ``value_step=None`` takes the keys' ``step``. Memory is the fixed width of ``bits``; a
            file saved with ``compress="best"`` stores grid codes near their entropy.
        sink_tokens: keep the first this many positions of the sequence in full precision (16-bit
            state dtype), never coded (0: none).
        center_keys: subtract a per-(batch, head) key mean (set at the first update that codes tokens)
            before coding keys and add it back after decoding. Both: :mod:`rvqstore.cache_state`.
    """

    def __init__(self, bits: tuple[int, int] | int = DEFAULT_BITS, seed: int = 0, residual: str = "conditional", *,
                 mode: str = "packed", dense_window: int = 0, flush_block: int = 64, use_kernels: bool = True,
                 value_bits: tuple[int, int] | int | None = None, step: float | None = None,
                 value_step: float | None = None, sink_tokens: int = 0, center_keys: bool = False):
        mode_impl = cache_modes.for_cache(mode)  # refuses an unknown mode
        state = cache_state.CodecState.make(sink_tokens, center_keys)  # refuses bad settings
        for name, v, lo in (("dense_window", dense_window, 0), ("flush_block", flush_block, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise CodecConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        value_step = step if value_step is None else value_step
        # the codec settings are checked now, not at first use
        key_step = checked_step(bits, seed, residual, step)
        value_step = checked_step(bits if value_bits is None else value_bits, seed, residual, value_step)
        self.codec_bits = _parse_bits(bits)
        self.value_bits = self.codec_bits if value_bits is None else _parse_bits(value_bits)
        self.step, self.value_step = key_step, value_step
        self.seed = seed
        self.residual = residual
        self._mode = mode_impl
        self.dense_window = dense_window
        self.flush_block = flush_block
        self.use_kernels = use_kernels
        self.offset = 0
        self._keys: _Stream | None = None
        self._values: _Stream | None = None
        self._dense_k: mx.array | None = None  # (B, H, offset - n_coded, Dk)
        self._dense_v: mx.array | None = None
        self.dtype: mx.Dtype | None = None
        self.geometry: tuple[int, int, int, int] | None = None  # (B, H, Dk, Dv)
        self._steps_off = False  # set when a compiled step path failed (rvqstore.cache_steps)
        # fixed once the code streams exist (_set_streams): what every step would otherwise ask again
        self._is_joint = False  # keys and values code alike (_joint)
        self._steps_apply = False  # joint and two-stage: the compiled step paths and GPU launches apply
        self._checked_shapes: tuple | None = None  # (keys, values) shapes of the last update that passed check_update
        self._step_fns: dict = {}  # rvqstore.cache_steps functions of this cache's codec and dtype
        self._state = state  # sink tokens and key mean (rvqstore.cache_state); None when both are off
        self._decode_step = None  # the steady decode step's bound launches (rvqstore.decode_step)
        attention.install()  # mlx-lm's attention calls reach attend_on_codes (rvqstore.attention.hook)
        if state is not None:
            register_with_mlx_lm()  # its mlx-lm prompt-cache files load back (from_state)

    # ---- helpers ----------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``"packed"`` or ``"resident"``: the mode object's name (rvqstore.cache_modes)."""
        return self._mode.name

    @property
    def n_coded(self) -> int:
        return 0 if self._keys is None else self._keys.n

    @property
    def n_dense(self) -> int:
        return self.offset - self.n_sink - self.n_coded

    # ---- codec state (rvqstore.cache_state) ---------------------------------------------------------
    @property
    def sink_tokens(self) -> int:
        return 0 if self._state is None else self._state.sink_tokens

    @property
    def center_keys(self) -> bool:
        return self._state is not None and self._state.center_keys

    @property
    def n_sink(self) -> int:
        """Sink positions held: ``min(offset, sink_tokens)``."""
        return 0 if self._state is None else self._state.n_sink

    @property
    def sink_keys(self) -> mx.array | None:
        """``(B, H, n_sink, Dk)`` in the state dtype (float32 where that is not finite), or None."""
        return None if self._state is None else self._state.sink_keys

    @property
    def sink_values(self) -> mx.array | None:
        return None if self._state is None else self._state.sink_values

    @property
    def key_mean(self) -> mx.array | None:
        """``(B, H, Dk)`` subtracted from keys before coding; None until set, or when not centering."""
        return None if self._state is None else self._state.key_mean

    def _codec(self, dim: int, bits: tuple[int, int] | None = None, step: float | None = None) -> RVQCodec:
        return RVQCodec(dim, bits or self.codec_bits, self.seed, self.residual, use_kernels=self.use_kernels,
                        step=step if bits else self.step)

    def _init_geometry(self, keys: mx.array, values: mx.array) -> None:
        """Check ``keys``/``values`` completely, then (first call only) fix geometry and dtype. Every
        check runs before any attribute changes: a refused call leaves the cache as it was."""
        shapes = self._checked_shapes  # a decode step repeats the last update's shapes: checked already
        if (shapes is not None and type(keys) is mx.array and type(values) is mx.array and keys.shape == shapes[0]
                and values.shape == shapes[1] and keys.dtype == self.dtype and values.dtype == self.dtype):
            return
        geo = check_update(keys, values, self.geometry)
        if self.geometry is not None:
            self._checked_shapes = (keys.shape, values.shape)
            return
        # raises on a bad head dim
        key_codec, value_codec = self._codec(geo[2]), self._codec(geo[3], self.value_bits, self.value_step)
        self.geometry = geo
        self.dtype = keys.dtype
        self._set_streams(key_codec, value_codec)

    def _set_streams(self, key_codec: RVQCodec, value_codec: RVQCodec) -> None:
        """New code streams for the geometry set; what depends only on them is decided here, once."""
        self._keys, self._values = _Stream(key_codec, self.geometry[:2]), _Stream(value_codec, self.geometry[:2])
        self._is_joint = self.geometry[2] == self.geometry[3] and key_codec.same_code(value_codec)
        self._steps_apply = self._is_joint and key_codec.bits2 > 0
        self._checked_shapes = None

    def _target_coded(self, total: int) -> int:
        if self.dense_window == 0:
            return total
        return max(0, (total - self.dense_window) // self.flush_block) * self.flush_block

    # ---- the mlx-lm protocol ------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` of shape (B, H, T, D) and return all keys/values so far."""
        step = self._decode_step  # a steady decode step's launches, bound (rvqstore.decode_step)
        if step is not None and decode_step.ENABLED:
            kv = step.update(self, keys, values)
            if kv is not None:
                return kv
        self._init_geometry(keys, values)
        t = keys.shape[2]
        if t == 0:  # as mlx-lm's KVCache: nothing appended, the (possibly empty) history returned
            return self._handed_out(self._fetch())
        start_coded = self._keys.n
        if self._state is None:
            if self.dense_window == 0:  # a model's decode step: every token coded
                self._append(keys, values)
            else:
                self._take(keys, values, self.offset)
        else:  # the positions that fall in the sink are held, not coded
            body = self.offset - self._state.n_sink
            keys, values = self._state.take_sink(keys, values, self.offset, self.dtype)
            if keys.shape[2]:
                self._take(keys, values, body)
        self.offset += t
        self._mode.extend(self, start_coded)  # resident: the decoded copy of the newly coded tokens
        kv = self._handed_out(self._fetch())
        if t == 1 and self._keys._count is not None and decode_step.ENABLED and self._state is None \
                and self.dense_window == 0:  # this step was written in place: bind it for the next ones
            decode_step.bind_update(self, keys, values)
        return kv

    def _take(self, keys: mx.array, values: mx.array, body: int) -> None:
        """Code ``keys``/``values`` (or keep them in the window), ``body`` positions after the sink held."""
        if self.dense_window == 0:
            self._append(keys, values)
            return
        dk = keys if self._dense_k is None else mx.concatenate([self._dense_k, keys], axis=2)
        dv = values if self._dense_v is None else mx.concatenate([self._dense_v, values], axis=2)
        flush = self._target_coded(body + keys.shape[2]) - self.n_coded
        if flush > 0:
            self._append(dk[:, :, :flush], dv[:, :, :flush])
            dk, dv = dk[:, :, flush:], dv[:, :, flush:]
        self._dense_k, self._dense_v = dk, dv

    def _handed_out(self, kv: tuple) -> tuple:
        """Remember (weakly) the keys/values handed to the model: attention on codes serves only calls
        that attend over exactly those (latent-attention models pass arrays derived from the cache's)."""
        # (a mode that never attends on its codes hands out nothing the hook would serve: no references kept)
        self._fetched = (weakref.ref(kv[0]), weakref.ref(kv[1])) if kv[0] is not None and \
            self._mode.attends_on_codes else None
        return kv

    def _joint(self) -> bool:
        """Keys and values share a head dim and code alike: encode/decode them in one codec call (half the
        dispatches). Equal bits are not enough: grids of other steps, or a file's tables, differ."""
        return self._is_joint  # decided with the streams (_set_streams): codecs never change

    def _append(self, keys: mx.array, values: mx.array) -> None:
        if self._state is not None:  # keys minus the mean (set from these keys at the first coded update)
            keys = self._state.centered(keys, self.dtype)
        if not self._is_joint:
            self._keys.append(keys)
            self._values.append(values)
            return
        # on a CUDA device: encode (resident: and decode) through one fused launch (rvqstore.cache_append;
        # what the launch writes is the mode's: rvqstore.cache_modes)
        if (self.use_kernels and self._steps_apply and self._mode.kernel_append(self, keys, values)) or \
                self._compiled_append(keys, values):
            return
        b = keys.shape[0]
        enc = self._keys.codec.encode(mx.concatenate([keys, values.astype(keys.dtype)], axis=0), check_finite=False)
        for stream, sl in ((self._keys, slice(0, b)), (self._values, slice(b, 2 * b))):
            stream.append_encoded(EncodedVectors(enc.scales[sl], enc.codes1[sl],
                                                 None if enc.codes2 is None else enc.codes2[sl], enc.dtype))

    def _steps_ok(self) -> bool:
        """The compiled per-step paths apply (rvqstore.cache_steps): joint, two-stage, not switched off."""
        return self._steps_apply and not self._steps_off

    def _write_codes(self, out: tuple, t: int) -> None:
        """Write a step's ``(ks, k1, k2, vs, v1, v2)`` after the coded tokens, with static slices (in
        place, as mlx-lm's KVCache does; the buffers grow in steps of _Stream.step)."""
        k, v = self._keys, self._values
        if t == 1 and self._mode.stages_steps:  # attention reads the decoded copy: write in blocks
            k.stage(out[0], out[1], out[2])
            v.stage(out[3], out[4], out[5])
            return
        n = k.n
        end = n + t
        k._grow(k.lead, end)
        v._grow(v.lead, end)
        ks, k1, k2 = k.buffers()  # staged steps written first
        vs, v1, v2 = v.buffers()
        # [:, :, n:end] rather than [..., n:end, :]: the same update, built in 2/3 of the host time
        ks[:, :, n:end], k1[:, :, n:end], k2[:, :, n:end] = out[0], out[1], out[2]
        vs[:, :, n:end], v1[:, :, n:end], v2[:, :, n:end] = out[3], out[4], out[5]
        k._n = v._n = end  # nothing staged now (buffers() wrote it)
        k._hw, v._hw = max(k._hw, end), max(v._hw, end)

    def _compiled_append(self, keys: mx.array, values: mx.array) -> bool:
        """Append through one compiled call; False where the unfused path must run (the first append,
        which also runs the kernels' first-use checks outside any trace, or a trace that failed)."""
        k, v = self._keys, self._values
        if k.n == 0 or k.scales is None or not self._steps_ok():
            return False
        t = keys.shape[2]
        # resident mode: the same call decodes the new tokens for the copy, once it holds every coded token
        decodes = self._mode.step_decodes(self, k.n + t)
        k._grow(k.lead, k.n + t)
        v._grow(v.lead, v.n + t)
        try:
            mean = None if self._state is None or not decodes else self._state.mean32
            fn = self._step_fns.get((decodes, mean is not None))
            if fn is None:  # looked up once per cache (the shared table's key hashes the codebooks)
                fn = self._step_fns[(decodes, mean is not None)] = cache_steps.append_fn(k.codec, decodes,
                                                                                       mean is not None)
            vals = values if values.dtype == keys.dtype else values.astype(keys.dtype)
            out = fn(keys, vals) if mean is None else fn(keys, vals, mean)
        except Exception:  # e.g. a kernel's first-use check inside a retrace: the unfused path from now on
            self._steps_off = True
            return False
        n, end = k.n, k.n + t
        self._write_codes(out, t)
        if decodes:
            self._mode.write(self, n, end, out[6].astype(self.dtype), out[7].astype(self.dtype))
        return True

    def _decode_range(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values of coded tokens [start, end) as handed out (keys with the mean added back)."""
        if not self._joint():
            k, v = self._keys.decode(start, end, self.dtype), self._values.decode(start, end, self.dtype)
        else:
            ek, ev = self._keys.encoded(start, end, self.dtype), self._values.encoded(start, end, self.dtype)
            both = self._keys.codec.decode(EncodedVectors(
                mx.concatenate([ek.scales, ev.scales]), mx.concatenate([ek.codes1, ev.codes1]),
                None if ek.codes2 is None else mx.concatenate([ek.codes2, ev.codes2]), self.dtype))
            b = ek.scales.shape[0]
            k, v = both[:b], both[b:]
        return (k, v) if self._state is None else (self._state.restored(k, self.dtype), v)

    def _fetch(self) -> tuple[mx.array, mx.array]:
        n = 0 if self._keys is None else self._keys.n
        k, v = self._mode.coded(self, n) if n else (None, None)  # packed: decoded; resident: the copy
        if self._state is None and self._dense_k is None and k is not None:  # a decode step: nothing else held
            return k, v
        if self.n_dense:
            dk, dv = self._dense_k.astype(self.dtype), self._dense_v.astype(self.dtype)
            k = dk if k is None else mx.concatenate([k, dk], axis=2)
            v = dv if v is None else mx.concatenate([v, dv], axis=2)
        if self._state is not None and not (n and self._mode.sink_in_copy):  # the sink goes in front
            k, v = self._state.in_front(k, v, self.dtype)
        if k is None:  # nothing held yet: empty (B, H, 0, D) arrays, as mlx-lm's KVCache returns
            b, h, dk, dv = self.geometry
            k, v = mx.zeros((b, h, 0, dk), self.dtype), mx.zeros((b, h, 0, dv), self.dtype)
        return k, v

    # ---- attention on the codes (rvqstore.attention) -------------------------------------------------
    def codes_view(self) -> attention.CodesView:
        """What attention on codes reads: the streams' buffers, the coded count and the window (the sink
        joined in front of it, keys minus the key mean: rvqstore.cache_state)."""
        k, v = self._keys, self._values
        kb, count = k.live()  # count: a pending in-place write's (both streams share it)
        vb = v.live()[0]
        if self._dense_k is None and self._state is None:  # a decode step's cache: the codes alone
            return attention.CodesView(k.codec, v.codec, self.geometry[1], k.n, kb, vb, None, None, count)
        dk, dv = (self._dense_k, self._dense_v) if self.n_dense else (None, None)
        if self._state is not None:
            dk, dv = self._state.attention_window(dk, dv)
        return attention.CodesView(k.codec, v.codec, self.geometry[1], k.n, kb, vb, dk, dv, count)

    def attend_on_codes(self, queries: mx.array, *, scale: float, mask=None, sinks=None) -> mx.array | None:
        """Attention of ``queries`` over this cache computed from the codes (packed mode), or None
        where decode-then-SDPA serves the call (resident mode holds decoded keys/values already;
        calls with many queries; see rvqstore.attention.dispatch)."""
        geo = self.geometry
        if not self._mode.attends_on_codes or geo is None or attention.dispatch.decode_first(self.offset):
            return None
        shape = queries.shape
        if len(shape) != 4 or shape[1] % geo[1] or shape[3] != geo[2]:
            raise InputShapeError(f"queries must be (B, n_heads, L, {geo[2]}) with n_heads a multiple "
                                  f"of {geo[1]}, got {tuple(shape)}")
        if self._state is not None:
            if sinks is not None and self._state.mean32 is not None:
                return None  # learned attention sinks do not shift with the keys: decode-then-SDPA
            mask = self._state.attention_mask(mask, queries.shape[2], self.n_coded, self.n_dense)
        step = self._decode_step
        if step is not None and decode_step.ENABLED:
            out = step.attend(self, queries, scale, mask, sinks)
            if out is not None:
                return out
        view = self.codes_view()
        out = attention.attend(view, queries, scale, mask, sinks, use_kernels=self.use_kernels)
        if step is not None and out is not None and sinks is None and decode_step.plain_mask(mask):
            decode_step.bind_attention(self, view, queries, scale)  # served by the kernels: bind them
        return out

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The decoded keys and values held (decoding the codes in packed mode)."""
        if self.offset == 0:
            raise InputShapeError("the cache is empty")
        return self._fetch()

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.geometry is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (dense window first, then codes, then the sink); returns how many
        were dropped."""
        n = max(0, min(self.offset, trim_count(n)))
        if n == 0:
            return 0
        keep = self.offset - n
        n_sink = self.n_sink
        if keep >= n_sink + self.n_coded:
            d = keep - n_sink - self.n_coded
            self._dense_k, self._dense_v = self._dense_k[:, :, :d], self._dense_v[:, :, :d]
        else:
            if self._keys is not None:
                self._keys.n = self._values.n = max(0, keep - n_sink)
            if self._dense_k is not None:
                self._dense_k, self._dense_v = self._dense_k[:, :, :0], self._dense_v[:, :, :0]
        if self._state is not None:  # into the sink; no coded token left: the mean goes (cache_state)
            self._state.trim(keep, self.n_coded)
        self.offset = keep
        return n

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        """The mask mlx-lm's KVCache would make at this offset (same function, same results)."""
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(n, offset=self.offset, return_array=return_array, window_size=window_size)

    @property
    def nbytes(self) -> int:
        """Bytes actually held: codes and scales (allocated capacity), window, resident copies."""
        total = 0
        for s in (self._keys, self._values):
            if s is not None:
                total += s.nbytes
        for a in (self._dense_k, self._dense_v):
            if a is not None:
                total += a.nbytes
        if self._state is not None:
            total += self._state.nbytes
        return total + self._mode.nbytes

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the used codes, scales, window, sink and key mean: what a snapshot of this cache stores."""
        if self.geometry is None:
            return 0
        total = 0
        for s in (self._keys, self._values):
            total += sum(a.nbytes for a in s.used() if a is not None)
        if self.n_dense:
            total += self._dense_k.nbytes + self._dense_v.nbytes
        if self._state is not None:
            total += self._state.nbytes
        return total

    # ---- state (mlx-lm's save/eval hooks; also what rvqstore snapshots hold) ---------------------------
    @property
    def state(self) -> tuple:
        """Arrays held: (k_scales, k_codes1, k_codes2, v_scales, v_codes1, v_codes2, k_dense, v_dense),
        then, for a cache with codec state, (sink_keys, sink_values, key_mean) (each None where absent)
        and :attr:`meta_state`, so that mlx-lm's ``save_prompt_cache``/``load_prompt_cache`` round-trip
        it (:meth:`from_state`)."""
        if self.geometry is None:
            return () if self._state is None else (self.meta_state,)
        ks, kc1, kc2 = self._keys.used()
        vs, vc1, vc2 = self._values.used()
        held = (ks, kc1, kc2, vs, vc1, vc2, self._dense_k, self._dense_v)
        # with codec state: its arrays, then the settings as strings (mlx-lm's files keep only state)
        return held if self._state is None else held + self._state.arrays() + (self.meta_state,)

    @property
    def meta_state(self) -> tuple[str, ...]:
        """Settings as strings (:data:`META_FIELDS`); a cache with codec state adds the rest of the fields
        (``sink_tokens``, ``center_keys`` "0"/"1", value bits, steps, head dims), enough to rebuild it."""
        b1, b2 = self.codec_bits
        dt = "" if self.dtype is None else str(self.dtype).split(".")[-1]
        meta = (str(b1), str(b2), str(self.seed), self.residual, self.mode, str(self.dense_window),
                str(self.flush_block), str(self.offset), dt)
        if self._state is None:
            return meta
        dk, dv = ("", "") if self.geometry is None else self.geometry[2:]
        return meta + (str(self._state.sink_tokens), str(int(self._state.center_keys)), str(self.value_bits[0]),
                       str(self.value_bits[1]), repr(self.step), repr(self.value_step), str(dk), str(dv))

    @classmethod
    def from_state(cls, state: Any, meta_state: Any = None) -> "RVQKVCache":
        """The cache whose :attr:`state` (and :attr:`meta_state`) this is: how mlx-lm's
        ``load_prompt_cache`` rebuilds caches (the state's last entry is the meta_state of a cache with
        codec state; older mlx-lm passes ``meta_state`` separately). A cache without codec state keeps
        no settings in its state: it is refused (save it with ``rvqstore.save_prompt_cache``)."""
        state = list(state) if isinstance(state, (list, tuple)) else state
        if meta_state is None and isinstance(state, list) and state and isinstance(state[-1], (list, tuple)):
            meta_state = state.pop()
        if not isinstance(state, list) or not isinstance(meta_state, (list, tuple)) or len(meta_state) != len(
                META_FIELDS) or not all(isinstance(x, str) for x in meta_state):
            raise InvalidArgumentError("RVQKVCache.from_state takes the state of a cache with codec state (its last "
                                       "entry the settings as strings); save other caches with "
                                       "rvqstore.save_prompt_cache")
        m = dict(zip(META_FIELDS, meta_state))
        try:
            kwargs = dict(bits=(int(m["bits1"]), int(m["bits2"])), seed=int(m["seed"]), residual=m["residual"],
                          mode=m["mode"], dense_window=int(m["dense_window"]), flush_block=int(m["flush_block"]),
                          value_bits=(int(m["value_bits1"]), int(m["value_bits2"])), step=_opt_float(m["step"]),
                          value_step=_opt_float(m["value_step"]), sink_tokens=int(m["sink_tokens"]),
                          center_keys=m["center_keys"] == "1")
            offset = int(m["offset"])
            if not state:
                return cls(**kwargs)
            dtype = DTYPE_BY_NAME[m["dtype"]]
            head_dims = (int(m["key_head_dim"]), int(m["value_head_dim"]))
        except (KeyError, ValueError) as err:
            raise InvalidArgumentError(f"RVQKVCache.from_state: malformed settings {tuple(meta_state)}: "
                                       f"{err}") from None
        if len(state) != 11:
            raise InvalidArgumentError(f"RVQKVCache.from_state: a state of 11 arrays expected, got {len(state)}")
        c = cls.from_packed(keys=tuple(state[0:3]), values=tuple(state[3:6]), dense_keys=state[6],
                            dense_values=state[7], dtype=dtype, head_dims=head_dims,
                            sink=None if state[8] is None else (state[8], state[9]), key_mean=state[10], **kwargs)
        if c.offset != offset:
            raise InputShapeError(f"RVQKVCache.from_state: the arrays hold {c.offset} tokens, the settings say "
                                  f"{offset}")
        return c

    @classmethod
    def from_packed(cls, *, keys: tuple[mx.array, mx.array, mx.array | None],
                    values: tuple[mx.array, mx.array, mx.array | None], dense_keys: mx.array | None,
                    dense_values: mx.array | None, dtype: mx.Dtype, head_dims: tuple[int, int],
                    key_codec: RVQCodec | None = None, value_codec: RVQCodec | None = None,
                    sink: tuple[mx.array, mx.array] | None = None, key_mean: mx.array | None = None,
                    check_scales: bool = True, **kwargs: Any) -> "RVQKVCache":
        """Build a cache from packed arrays (scales, codes1, codes2) of keys and values, its window
        ``dense_keys``/``dense_values`` and codec state (``kwargs`` carry ``sink_tokens``/``center_keys``
        as for the constructor): ``sink`` ``(sink_keys, sink_values)`` of ``min(offset, sink_tokens)``
        positions, ``key_mean`` ``(B, H, Dk)`` exactly when ``center_keys`` and tokens are coded.
        ``check_scales=False``: the caller has checked the scales' values (:meth:`RVQCodec.check_scales`), as a
        load does for all of a file's layers in one reduction; shapes and dtypes are checked all the same."""
        c = cls(**kwargs)
        ks = keys[0] if isinstance(keys, (tuple, list)) and keys else None
        if not isinstance(ks, mx.array) or ks.ndim != 3:
            raise InputShapeError("keys must be (scales, codes1, codes2) with scales of shape (B, heads, tokens)")
        b, h, n = ks.shape
        c.geometry = (b, h, head_dims[0], head_dims[1])
        c.dtype = dtype
        c._set_streams(key_codec or c._codec(head_dims[0]),
                       value_codec or c._codec(head_dims[1], c.value_bits, c.value_step))
        c.codec_bits, c.value_bits = c._keys.codec.bits, c._values.codec.bits
        c.step, c.value_step = c._keys.codec.step, c._values.codec.step  # the codecs' tables rule
        for stream, packed, d in ((c._keys, keys, head_dims[0]), (c._values, values, head_dims[1])):
            stream.check_packed(packed, (b, h, n), d, dtype, head_dims, scales=check_scales)
        c._keys.set_packed(*keys)
        c._values.set_packed(*values)
        nd = 0
        for name, a, d in (("dense_keys", dense_keys, head_dims[0]), ("dense_values", dense_values, head_dims[1])):
            if a is not None and (not isinstance(a, mx.array) or a.ndim != 4 or a.shape[:2] != (b, h)
                                  or a.shape[3] != d or dense_keys is None or dense_values is None
                                  or a.shape[2] != dense_keys.shape[2]):
                raise InputShapeError(f"{name} must be (B, heads, T, D) = ({b}, {h}, T, {d}) beside the other, "
                                      f"got {getattr(a, 'shape', type(a).__name__)}")
        if dense_keys is not None and dense_keys.shape[2]:
            nd = dense_keys.shape[2]
        # checked against the settings (no state: neither may be given), then held
        state = c._state if c._state is not None else cache_state.CodecState(0, False)
        n_sink = state.load(sink, key_mean, c.geometry, n, nd)
        if nd:
            c._dense_k, c._dense_v = dense_keys, dense_values
        c.offset = n_sink + n + nd
        c._mode.extend(c, 0)  # resident: decode the loaded codes into the copy
        return c

    # ---- conversion from mlx-lm caches ----------------------------------------------------------------
    @classmethod
    def from_kv_cache(cls, cache: Any, **kwargs: Any) -> "RVQKVCache":
        """Encode the used part of an mlx-lm ``KVCache`` or ``QuantizedKVCache`` into a new RVQKVCache."""
        from .compat import dense_keys_values

        c = cls(**kwargs)
        kv = dense_keys_values(cache)
        if kv is not None:
            c.update_and_fetch(*kv)
        return c

    def __repr__(self) -> str:
        steps = "" if self.step is None and self.value_step is None else (
            f"step={self.step}, " + (f"value_step={self.value_step}, " if self.value_step != self.step else ""))
        values = f"value_bits={self.value_bits}, " if self.value_bits != self.codec_bits else ""
        state = "" if self._state is None else (
            (f"sink_tokens={self.sink_tokens}, " if self.sink_tokens else "")
            + ("center_keys=True, " if self.center_keys else ""))
        sink = f"sink={self.n_sink}, " if self.sink_tokens else ""
        return (f"RVQKVCache(bits={self.codec_bits}, {values}{steps}{state}mode={self.mode!r}, offset={self.offset}, "
                f"{sink}coded={self.n_coded}, dense={self.n_dense}, nbytes={self.nbytes})")


def register_with_mlx_lm() -> None:
    """Make :class:`RVQKVCache` known to mlx-lm's ``load_prompt_cache``, which finds cache classes by name
    in ``mlx_lm.models.cache``. Runs when this module is imported after mlx-lm and when a cache is made;
    a process that loads such a file before either calls it itself."""
    lm = sys.modules.get("mlx_lm.models.cache")
    if lm is not None and getattr(lm, "RVQKVCache", None) is not RVQKVCache:
        lm.RVQKVCache = RVQKVCache


register_with_mlx_lm()
