"""The modes of the RVQ caches, a class each: what a cache holds beside its codes, what an update
hands back, and whether attention may read the codes.

- packed (:class:`Packed` for ``RVQKVCache``, :class:`PackedWindow` for ``RVQRotatingKVCache``):
  codes and scales only. An update hands back a decode of the coded tokens (built lazily; where
  attention on codes serves the model's call it is never evaluated); the least memory, the most
  work per generated token.
- resident (:class:`Resident`, :class:`ResidentWindow`): the codes are still the state (what is
  saved), and a decoded copy of the coded tokens in the model's dtype is kept beside them and
  extended as tokens are coded, so each token is decoded once; an update hands back that copy, and
  attention runs on it (decode-then-SDPA), never on the codes.

A cache holds one mode object, made from its ``mode=`` string by :func:`for_cache` or
:func:`for_window`, and calls it where the modes differ instead of branching on the string; what a
mode is for both kinds sits in a base (:class:`CodesOnly`, :class:`DecodedCopy`). The caches keep
what does not differ: the code streams, the window, ``_decode_range`` and the compiled step paths.
``RVQKVCache``'s modes carry its GPU step paths (:mod:`rvqstore.cache_append`,
:mod:`rvqstore.cache_fetch`) and grow the copy in steps, writing new tokens in place (as mlx-lm's
KVCache); ``RVQRotatingKVCache``'s keep exactly the window, cut with it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import cache_append, cache_fetch, cache_steps
from .errors import CodecConfigError

MODES = ("packed", "resident")


def check_mode(mode: Any) -> None:
    if mode not in MODES:
        raise CodecConfigError(f"mode must be one of {MODES}, got {mode!r}")


def for_cache(mode: str) -> "CodesOnly | DecodedCopy":
    """The mode object of an ``RVQKVCache`` made with ``mode=``."""
    check_mode(mode)
    return Packed() if mode == "packed" else Resident()


def for_window(mode: str) -> "CodesOnly | DecodedCopy":
    """The mode object of an ``RVQRotatingKVCache`` made with ``mode=``."""
    check_mode(mode)
    return PackedWindow() if mode == "packed" else ResidentWindow()


def cut(a: mx.array, keep: int, tail: int) -> mx.array:
    """Along axis 2: the first ``keep`` entries and the last ``tail`` ones."""
    n = a.shape[2]
    return mx.concatenate([a[:, :, :keep], a[:, :, n - tail:]], axis=2)


class CodesOnly:
    """Packed mode, both kinds: nothing held beside the codes; updates hand back a decode of them."""

    __slots__ = ()
    name = "packed"
    attends_on_codes = True
    nbytes = 0

    def extend(self, cache: Any, start: int) -> None:
        """Nothing to keep up to date after tokens [start, n) were coded."""


class Packed(CodesOnly):
    """RVQKVCache's packed mode: a step's codes written at once (attention reads the code buffers);
    what an update hands back is one launch (CUDA) or one compiled call where the step paths apply."""

    __slots__ = ()
    stages_steps = False
    sink_in_copy = False  # what coded() returns starts at the first coded token

    def coded(self, cache: Any, n: int) -> tuple[mx.array, mx.array]:
        """The first ``n`` coded tokens decoded: one launch (CUDA) or one compiled call sliced to the
        used part where the step paths apply, else the codec's decode."""
        if not cache._steps_apply or cache._steps_off:
            return cache._decode_range(0, n)
        ks = cache._keys
        kb, count = ks.live()  # count: a pending in-place write's, which the launch must take
        vb = cache._values.live()[0]
        kv = cache_fetch.fetch(ks.codec, kb, vb, n, cache.dtype, count) if cache.use_kernels else None
        state = cache._state
        if kv is not None:  # the launch decodes the codes; a centering cache adds its key mean back
            return kv if state is None or state.mean32 is None else (state.restored(kv[0], cache.dtype), kv[1])
        kb, vb = ks.buffers(), cache._values.buffers()  # MLX ops read them: any pending write finished first
        mean = None if state is None else state.mean32
        fn = cache._step_fns.get(("decode", mean is not None))
        if fn is None:
            fn = cache._step_fns[("decode", mean is not None)] = cache_steps.decode_fn(ks.codec, cache.dtype,
                                                                                     mean is not None)
        k, v = fn(*kb, *vb) if mean is None else fn(*kb, *vb, mean)
        return k[:, :, :n], v[:, :, :n]

    def step_decodes(self, cache: Any, need: int) -> bool:
        """Whether the compiled step also decodes the new tokens: not for packed caches."""
        return False

    def kernel_append(self, cache: Any, keys: mx.array, values: mx.array) -> bool:
        """(CUDA) append through the fused kernel: written in place where the buffers have room (one
        launch, no slice updates, no copy); when they grow (or up to ``COPY_MAX_TOKENS``, where in place
        is refused) whole new buffers from the copy append; else the launch's codes written with static
        slices."""
        k = cache._keys
        if k.n and k.inplace_ok(keys.shape[2]) and self._inplace_append(cache, keys, values):
            return True
        if k.n and self._copy_append(cache, keys, values):
            return True
        out = cache_append.append(k.codec, keys, values, False)
        if out is None:
            return False
        cache._write_codes(out, keys.shape[2])
        return True

    @staticmethod
    def _inplace_append(cache: Any, keys: mx.array, values: mx.array) -> bool:
        k, v = cache._keys, cache._values
        kb, count = k.live()
        vb = v.live()[0]
        done = cache_append.append_inplace(k.codec, keys, values, kb, vb, k.n, count)
        if done is None:
            return False
        t = keys.shape[2]
        k.wrote_inplace(t, done)
        v.wrote_inplace(t, done)
        return True

    @staticmethod
    def _copy_append(cache: Any, keys: mx.array, values: mx.array) -> bool:
        """The kernel writes whole new buffers (old tokens + new): when the buffers grow, once after a
        trim, and at short contexts (rvqstore.cache_append.COPY_MAX_TOKENS), so the step needs no slice
        updates."""
        k, v = cache._keys, cache._values
        kb, count = k.live()  # the copy reads the old buffers in the kernel: it takes a pending write's count
        vb = v.live()[0]
        n, cap = k.n, kb[0].shape[-1]
        need = n + keys.shape[2]
        if need > cap:
            cap = -(-need // k.step) * k.step
        # below _hw (after a trim) nothing is written in place: new buffers once make that possible again
        renew = cache_append.INPLACE and n < k._hw
        out = cache_append.append_copy(k.codec, keys, values, kb, vb, n, cap, count, renew)
        if out is None:
            return False
        k.take_buffers(out[0], out[1], out[2], need)
        v.take_buffers(out[3], out[4], out[5], need)
        return True


class PackedWindow(CodesOnly):
    """RVQRotatingKVCache's packed mode: an update hands back the window decoded."""

    __slots__ = ()

    def coded(self, cache: Any, n: int) -> tuple[mx.array, mx.array]:
        return cache._decode_range(0, n)

    def cut(self, keep: int, tail: int) -> None:
        """Nothing to cut beside the codes."""

    def truncate(self, n: int) -> None:
        """Nothing to trim beside the codes."""


class DecodedCopy:
    """Resident mode, both kinds: a decoded copy of the coded keys and values beside the codes."""

    __slots__ = ("keys", "values")
    name = "resident"
    attends_on_codes = False  # attention runs on the decoded copy

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.values) if a is not None)


class Resident(DecodedCopy):
    """RVQKVCache's decoded copy: buffers grown in steps (like mlx-lm's KVCache), new tokens written
    in place; a step's codes are staged and written in blocks (:meth:`rvqstore.cache._Stream.stage`).

    A cache with sink tokens (:mod:`rvqstore.cache_state`) has them in the copy's first ``front`` rows
    (written whenever the copy starts over at coded token 0: the sink is complete and fixed while any
    token is coded), so what an update hands back is one slice of the copy, never a concatenation of
    the whole history; the keys' mean is added once, as tokens are decoded into the copy."""

    __slots__ = ("_written",)
    stages_steps = True  # attention reads the decoded copy, not the code buffers
    sink_in_copy = True  # coded() returns the sink rows, then the coded tokens

    def __init__(self):
        super().__init__()
        self._written = False  # this update's append wrote the new tokens' decoded copy already

    def extend(self, cache: Any, start: int) -> None:
        """Decode tokens [start, n_coded) into the copy (unless the append wrote them already)."""
        end = cache.n_coded
        if self._written:
            self._written = False
            return
        if end <= start:
            return
        nk, nv = cache._decode_range(start, end)
        self.grow(cache, start, end)
        f = cache.sink_tokens
        self.keys[:, :, f + start:f + end] = nk
        self.values[:, :, f + start:f + end] = nv
        if start == 0:
            self._write_sink(cache)

    def _write_sink(self, cache: Any) -> None:
        if cache.sink_tokens:
            f = cache.sink_tokens
            self.keys[:, :, :f] = cache.sink_keys.astype(cache.dtype)
            self.values[:, :, :f] = cache.sink_values.astype(cache.dtype)

    def coded(self, cache: Any, n: int) -> tuple[mx.array, mx.array]:
        """The sink rows (if any) and the first ``n`` coded tokens."""
        f = cache.sink_tokens
        return self.keys[:, :, :f + n], self.values[:, :, :f + n]

    def grow(self, cache: Any, keep: int, need: int) -> None:
        """Room for ``need`` tokens (grown in steps of the streams' step) after the sink rows, the first
        ``keep`` (and the sink rows) kept."""
        f = cache.sink_tokens
        cap = 0 if self.keys is None else self.keys.shape[2] - f
        if need <= cap:
            return
        step = cache._keys.step
        new_cap = f + -(-need // step) * step
        b, h, dk, dv = cache.geometry
        rk, rv = mx.zeros((b, h, new_cap, dk), cache.dtype), mx.zeros((b, h, new_cap, dv), cache.dtype)
        if keep:
            rk[:, :, :f + keep] = self.keys[:, :, :f + keep]
            rv[:, :, :f + keep] = self.values[:, :, :f + keep]
        self.keys, self.values = rk, rv

    def write(self, cache: Any, start: int, end: int, keys: mx.array, values: mx.array) -> None:
        """A step's decoded new tokens [start, end), from the same call that coded them."""
        f = cache.sink_tokens
        self.keys[:, :, f + start:f + end] = keys
        self.values[:, :, f + start:f + end] = values
        if start == 0:
            self._write_sink(cache)
        self._written = True

    def step_decodes(self, cache: Any, need: int) -> bool:
        """Whether the compiled step also decodes the new tokens (once the copy holds every coded token
        in the cache's dtype); if so, the copy is grown to ``need`` tokens for them."""
        if self.keys is None or self.keys.dtype != cache.dtype:
            return False
        if self.keys.shape[2] - cache.sink_tokens < need:
            self.grow(cache, cache._keys.n, need)
        return True

    def kernel_append(self, cache: Any, keys: mx.array, values: mx.array) -> bool:
        """(CUDA) one launch codes the new tokens and decodes them for the copy: the codes written in place
        where the buffers have room (as packed caches do; then nothing is staged), else staged or written
        with slice updates."""
        k, v = cache._keys, cache._values
        if self.keys is None and k.n:  # the decoded copy must cover every coded token
            return False
        n, t = k.n, keys.shape[2]
        out = None
        if t == 1 and n and k._scales is not None and n >= k._hw and cache_append.serves_inplace(k.codec, keys, values):
            # full buffers: grow them now (as the staged block's write would 16 steps later), so this step
            # and the next ones write in place and bind (rvqstore.decode_step) instead of staging codes
            k._grow(k.lead, n + t)
            v._grow(v.lead, v.n + t)
        if n and cache_append.INPLACE and k.inplace_ok(t):
            kb, count = k.live()  # staged steps written first: in place goes after them
            out = cache_append.append_inplace(k.codec, keys, values, kb, v.live()[0], n, count, True)
        if out is not None:
            k.wrote_inplace(t, out[0])
            v.wrote_inplace(t, out[0])
            decoded = out[1:]
        else:
            out = cache_append.append(k.codec, keys, values, True)
            if out is None:
                return False
            cache._write_codes(out, t)
            decoded = out[6:]
        self.grow(cache, n, n + t)
        dk = decoded[0] if cache._state is None else cache._state.restored(decoded[0], cache.dtype)  # key mean back
        self.write(cache, n, n + t, dk, decoded[1])
        return True


class ResidentWindow(DecodedCopy):
    """RVQRotatingKVCache's decoded copy: exactly the window (sinks first), cut with it."""

    __slots__ = ()

    def extend(self, cache: Any, start: int) -> None:
        """Decode tokens [start, n_held) and put them after the copy's first ``start`` tokens."""
        nk, nv = cache._decode_range(start, cache.n_held)
        if self.keys is None or start == 0:
            self.keys, self.values = nk, nv
        else:
            self.keys = mx.concatenate([self.keys[:, :, :start], nk], axis=2)
            self.values = mx.concatenate([self.values[:, :, :start], nv], axis=2)

    def coded(self, cache: Any, n: int) -> tuple[mx.array, mx.array]:
        return self.keys, self.values  # the whole window: n is what it holds

    def cut(self, keep: int, tail: int) -> None:
        if self.keys is not None:
            self.keys, self.values = cut(self.keys, keep, tail), cut(self.values, keep, tail)

    def truncate(self, n: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
