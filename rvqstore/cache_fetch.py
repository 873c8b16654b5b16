"""What a packed cache's ``update_and_fetch`` hands back, as one GPU launch (``kernels/rvq_unpack.inc``).

mlx-lm's models take keys and values from ``update_and_fetch`` and pass them to attention; for a
packed cache the hook (:mod:`rvqstore.attention.hook`) serves that call from the codes, so the
returned decode is built every step and evaluated never. Built with MLX ops it is a compiled call of
a dozen primitives plus two slices, a cost paid on the host per layer and step; here it is one node
(the decoded first ``n`` tokens of the key and value buffers). Evaluated (a model that does its own
attention math), it is bit-identical to the codec's decode: the first use of each configuration
compares it with :func:`rvqstore.cache_steps.decode_fn` and latches the kernel off (logged once)
where they differ. CUDA only; the configurations of :mod:`rvqstore.cache_append`.
"""

from __future__ import annotations

import hashlib
import threading

import mlx.core as mx
import numpy as np

from . import cache_append, cache_steps, first_use, fused, kernel_cache
from .kernel_plan import DECODE, make_plan


_lock = threading.Lock()
_kernel_fn: list = []
_disabled: dict = {}
_verified: set = set()
_MISSING = object()


def _kernel():
    if not _kernel_fn:
        header = fused.load_source("rvq_prelude_cuda.cuh") + "\n" + fused.load_source("rvq_common.h")
        body = fused.load_source("rvq_attend_body_prelude_cuda.inc") + fused.load_source("rvq_unpack.inc")
        digest = hashlib.sha1((header + body).encode()).hexdigest()[:12]
        _kernel_fn.append(kernel_cache.cuda_kernel(  # compiled once per machine
            name=f"rvq_unpack_{digest}",
            input_names=["ks", "k1", "k2", "vs", "v1", "v2", "sg", "dtab", "cnt", "params"],
            output_names=["ko", "vo"], source=body, header=header, ensure_row_contiguous=True))
    return _kernel_fn[0]


class _Setup:
    def __init__(self, codec):
        plan = make_plan(codec, DECODE)
        if isinstance(plan, str):
            raise ValueError(plan)
        self.dtab = plan.tab
        self.signs = mx.array(np.asarray(codec.signs, np.float32))
        self.template = [("T_D", codec.dim), ("T_B1", plan.bits1), ("T_B2", plan.bits2), ("T_MODE", plan.mode)]
        self.params: dict = {}
        self.configs: dict = {}
        self.calls: dict = {}  # (buffers' shape, dtype) -> cache_append._Call (its grid and outputs per n)
        self.base = (codec.dim, codec.bits1, codec.bits2, codec.residual, codec.seed)

    def args(self, cap: int, bh: int) -> mx.array:
        a = self.params.get((cap, bh))
        if a is None:  # changes only when the buffers grow
            if len(self.params) > 16:
                self.params.clear()
            a = self.params[(cap, bh)] = mx.array([cap, bh], dtype=mx.uint32)
        return a

    def call(self, shape: tuple, dtype) -> "cache_append._Call":
        """The launch's arguments for key buffers of ``shape`` (made once per capacity and dtype)."""
        c = self.calls.get((shape, dtype))
        if c is None:
            b, h, cap = shape
            if len(self.calls) > 16:
                self.calls.clear()
            c = self.calls[(shape, dtype)] = cache_append._Call(
                _kernel(), self.template + [("OutT", dtype)], [], [self.signs, self.dtab, self.args(cap, b * h)],
                None, [dtype, dtype], None, (self.template[0][1], 1, 1))
        return c


_SETUP = "cache_fetch"  # this module's entry in codec.launch_setups


def _setup(codec):
    s = codec.launch_setups.get(_SETUP, _MISSING)
    if s is _MISSING:
        try:
            s = _Setup(codec) if cache_append.supported(codec) is None else None
        except ValueError:
            s = None
        codec.launch_setups[_SETUP] = s
    return s


def launch(codec, key_buffers: tuple, value_buffers: tuple, n: int, dtype,
           count: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Decoded keys and values ``(B, H, n, D)`` in ``dtype`` of the buffers' first ``n`` tokens (``count``:
    ``[n]``, a pending in-place write's if any: see rvqstore.cache._Stream)."""
    s = _setup(codec)
    shape = key_buffers[0].shape
    b, h, _ = shape
    d = codec.dim
    c = s.call(shape, dtype)
    signs, dtab, args = c.consts  # args: [capacity, B * H], fixed with the buffers' shape
    cnt = cache_append.shared_count(n) if count is None else count
    out = c([*key_buffers, *value_buffers, signs, dtab, cnt, args],
            (2 * b * h * n * d, 1, 1), [(b, h, n, d), (b, h, n, d)])
    return out[0], out[1]


def bind(codec, key_buffers: tuple, value_buffers: tuple, dtype) -> tuple | None:
    """What :func:`launch` hands MLX for these buffers, for a caller that repeats it every step
    (:mod:`rvqstore.decode_step`): ``(run, inputs, threadgroup)``, the launch being ``run(inputs,
    [(B, H, n, D)] * 2, (2 * B * H * n * D, 1, 1), threadgroup)`` once the caller put in the count
    ``[n]`` (input 8). None until this configuration's first use passed and a launch prepared it."""
    s = _setup(codec)
    if s is None:
        return None
    config = s.configs.get(dtype)
    if config is None or config not in _verified or config in _disabled:
        return None
    c = s.call(key_buffers[0].shape, dtype)
    if c.run is None:
        return None
    signs, dtab, args = c.consts
    return c.run, [*key_buffers, *value_buffers, signs, dtab, None, args], c.threadgroup


def fetch(codec, key_buffers: tuple, value_buffers: tuple, n: int, dtype,
          count: mx.array | None = None) -> tuple | None:
    """``(keys, values)`` decoded from the buffers by one launch, or None (no CUDA device, a
    configuration the kernel does not take, latched off): then the caller decodes with MLX ops."""
    if n == 0 or fused.gpu_backend() != "cuda" or not fused._on_gpu():
        return None
    s = _setup(codec)
    if s is None:
        return None
    config = s.configs.get(dtype)
    if config is None:
        config = s.configs[dtype] = s.base + (str(dtype),)
    if config in _verified and config not in _disabled:  # checked: launch (a failure goes through serve)
        try:
            return launch(codec, key_buffers, value_buffers, n, dtype, count)
        except Exception:
            pass
    if count is not None:  # the first use reads the buffers with MLX ops too: the write must be done
        mx.eval(count)

    def same_as_decode(out):  # bit for bit the MLX-ops decode
        k, v = cache_steps.decode_fn(codec, dtype)(*key_buffers, *value_buffers)
        same = [mx.array_equal(a, b[:, :, :n], equal_nan=True) for a, b in zip(out, (k, v))]
        return None if all(bool(x.item()) for x in same) else "differs from the codec's decode"

    return first_use.serve(config, lambda: launch(codec, key_buffers, value_buffers, n, dtype, count), same_as_decode,
                           verified=_verified, disabled=_disabled, lock=_lock,
                           what="fused unpack kernel (MLX-ops decode instead)")


def disabled() -> dict:
    with _lock:
        return dict(_disabled)
