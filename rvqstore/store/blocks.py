"""Entry encoding: one block of a prompt's KV cache (all layers, tokens [start, end)) as ``.rvq`` bytes,
and back.

A block is an ordinary ``.rvq`` file (``rvqstore inspect`` reads it): rvq layers holding the block's
codes and scales, its token ids, the model fingerprint, and in ``metadata`` the block's place in the
store (``store.key``, ``store.parent``, ``store.start``).  Reading one checks every byte (the header
and section checksums) and that the block is the one asked for: same key, parent, token ids, codec
and geometry; anything else is a :class:`CorruptBlockError`.

Caches are cut into blocks here too (:func:`encode_range`): an :class:`RVQKVCache` with the store's
codec gives its codes as they are (tokens still in its full-precision window are encoded); an
mlx-lm ``KVCache`` / ``QuantizedKVCache`` is encoded with the store's codec.  Rotating windows and
recurrent states are refused (:class:`UnsupportedCacheError` naming the kind): a block of a prefix
must hold exactly the keys and values of those tokens, which a window that has dropped old tokens
or a state that mixes all tokens cannot give.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from ..cache import RVQKVCache
from ..codec import DTYPE_BY_NAME, RVQCodec, scales_pass
from ..compat import UnsupportedCacheError, dense_keys_values
from ..format import FormatError, Section, open_rvq, write_rvq
from ..snapshot.decode import layer_key, read_arrays
from .errors import CorruptBlockError, StoreConfigError



@dataclass
class Packed:
    """Codes of one side (keys or values) of one layer for a run of tokens: shapes (B, H, T[, W])."""

    scales: mx.array
    codes1: mx.array
    codes2: mx.array | None

    def slice(self, a: int, b: int) -> "Packed":
        return Packed(self.scales[:, :, a:b], self.codes1[:, :, a:b],
                      None if self.codes2 is None else self.codes2[:, :, a:b])

    @staticmethod
    def concat(parts: Sequence["Packed"]) -> "Packed":
        if len(parts) == 1:
            return parts[0]
        c2 = None if parts[0].codes2 is None else mx.concatenate([p.codes2 for p in parts], axis=2)
        return Packed(mx.concatenate([p.scales for p in parts], axis=2),
                      mx.concatenate([p.codes1 for p in parts], axis=2), c2)


@dataclass
class LayerRun:
    """One layer's keys and values for a run of tokens, as codes."""

    keys: Packed
    values: Packed
    dtype: mx.Dtype
    head_dim: int


def _dtype_name(dt: mx.Dtype) -> str:
    return str(dt).split(".")[-1]


def _packed(enc) -> Packed:
    return Packed(enc.scales, enc.codes1, enc.codes2)


def _encode_dense(codec: RVQCodec, keys: mx.array, values: mx.array) -> tuple[Packed, Packed]:
    b = keys.shape[0]
    enc = codec.encode(mx.concatenate([keys, values.astype(keys.dtype)], axis=0), check_finite=False)
    both = _packed(enc)
    return (Packed(both.scales[:b], both.codes1[:b], None if both.codes2 is None else both.codes2[:b]),
            Packed(both.scales[b:], both.codes1[b:], None if both.codes2 is None else both.codes2[b:]))


def _codec_for(settings: tuple, dim: int, memo: dict) -> RVQCodec:
    key = (dim,) + settings
    if key not in memo:
        bits, seed, residual = settings
        memo[key] = RVQCodec(dim, bits, seed, residual)
    return memo[key]


def encode_range(cache: Sequence[Any], start: int, end: int, settings: tuple) -> list[LayerRun]:
    """Codes of tokens [start, end) of every layer of ``cache``, with the codec ``settings``
    ``(bits, seed, residual)``; one codec call per layer for the whole range."""
    memo: dict = {}
    runs = []
    for i, c in enumerate(cache):
        if type(c) is RVQKVCache:  # subclasses may hold other kinds of state
            runs.append(_rvq_range(c, i, start, end, settings))
            continue
        kv = dense_keys_values(c) if _plain_kind(c) else None
        if kv is None:
            if not _plain_kind(c):
                raise UnsupportedCacheError(
                    f"layer {i} is a {type(c).__name__}: the prefix store holds plain attention layers "
                    f"(RVQKVCache, KVCache, QuantizedKVCache); rotating windows and recurrent states have no "
                    f"per-token keys/values for every prefix")
            raise StoreConfigError(f"layer {i} holds no tokens")
        k, v = kv
        if k.shape[2] < end:
            raise StoreConfigError(f"layer {i} holds {k.shape[2]} tokens, fewer than {end}")
        if k.shape[-1] != v.shape[-1]:
            raise UnsupportedCacheError(f"layer {i}: keys and values of different head dims are not supported")
        codec = _codec_for(settings, k.shape[-1], memo)
        kp, vp = _encode_dense(codec, k[:, :, start:end], v[:, :, start:end])
        runs.append(LayerRun(kp, vp, k.dtype, k.shape[-1]))
    return runs


def _plain_kind(c: Any) -> bool:
    from mlx_lm.models import cache as lm

    return type(c) in (lm.KVCache, lm.QuantizedKVCache)


def _rvq_range(c: RVQKVCache, i: int, start: int, end: int, settings: tuple) -> LayerRun:
    if c.geometry is None or c.offset < end:
        raise StoreConfigError(f"layer {i} holds {c.offset} tokens, fewer than {end}")
    mine = (c.codec_bits, c.seed, c.residual if c.codec_bits[1] else "conditional")
    want = (tuple(settings[0]), settings[1], settings[2] if settings[0][1] else "conditional")
    if getattr(c, "value_bits", c.codec_bits) != c.codec_bits:
        raise StoreConfigError(f"layer {i} codes values with bits {c.value_bits}, keys with {c.codec_bits}: the "
                               f"store holds one codec setting for both (per-side bits are not supported yet)")
    if getattr(c, "step", None) is not None or getattr(c, "value_step", None) is not None:
        raise StoreConfigError(f"layer {i} codes with a uniform grid (step {c.step}): the store's blocks hold "
                               f"Lloyd–Max codes only (grids are not supported there yet)")
    if getattr(c, "sink_tokens", 0) or getattr(c, "center_keys", False):
        raise StoreConfigError(f"layer {i} keeps codec state (sink_tokens {c.sink_tokens}, center_keys "
                               f"{c.center_keys}): the store's blocks hold plain codes only (codec state is "
                               f"not supported there yet)")
    if mine != want:
        raise StoreConfigError(f"layer {i} is coded with bits/seed/residual {mine}, the store with {want}: "
                               f"re-encoding would add a second quantization error")
    b, h, dk, dv = c.geometry
    if dk != dv:
        raise UnsupportedCacheError(f"layer {i}: keys and values of different head dims are not supported")
    parts_k, parts_v = [], []
    nc = c.n_coded
    if start < nc:
        e = min(end, nc)
        parts_k.append(Packed(*c._keys.used()).slice(start, e))
        parts_v.append(Packed(*c._values.used()).slice(start, e))
    if end > nc:  # tokens still in the full-precision window: encode them as a flush would
        a = max(start, nc) - nc
        kp, vp = _encode_dense(c._keys.codec, c._dense_k[:, :, a:end - nc], c._dense_v[:, :, a:end - nc])
        parts_k.append(kp)
        parts_v.append(vp)
    return LayerRun(Packed.concat(parts_k), Packed.concat(parts_v), c.dtype, dk)


def encode_block(runs: Sequence[LayerRun], a: int, b: int, *, tokens: np.ndarray, quantizer: dict,
                 fingerprint: dict | None, metadata: dict[str, str], tmp_dir: str | None = None) -> bytes:
    """The ``.rvq`` bytes of tokens [a, b) of ``runs`` (indices into the runs), ``tokens`` being theirs."""
    layers, sections = [], [Section("tokens", -1, "tokens", np.asarray(tokens, dtype=np.int32))]
    for i, r in enumerate(runs):
        k, v = r.keys.slice(a, b), r.values.slice(a, b)
        bsz, h = k.scales.shape[:2]
        layers.append({"index": i, "kind": "rvq", "batch": bsz, "n_kv_heads": h, "head_dim": r.head_dim,
                       "n_tokens": b - a, "n_dense_tokens": 0,
                       "key_dtype": _dtype_name(r.dtype), "value_dtype": _dtype_name(r.dtype)})
        for side, p in (("keys", k), ("values", v)):
            sections.append(Section(f"layers.{i}.{side}.codes1", i, f"{side}.codes1", p.codes1))
            if p.codes2 is not None:
                sections.append(Section(f"layers.{i}.{side}.codes2", i, f"{side}.codes2", p.codes2))
            sections.append(Section(f"layers.{i}.{side}.scales", i, f"{side}.scales", p.scales))
    header = {"n_tokens": b - a, "layers": layers, "quantizer": quantizer, "model": fingerprint,
              "metadata": dict(metadata), "cache": {"mode": "packed", "dense_window": 0, "flush_block": 64}}
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix=".rvqstore-block-") as d:
        path = os.path.join(d, "block.rvq")
        write_rvq(path, header, sections, compress="auto")
        with open(path, "rb") as f:
            return f.read()


@dataclass
class BlockData:
    """A block read back and checked: its layers' codes."""

    layers: list[LayerRun]
    n_tokens: int


def decode_block(f, *, key: str, parent: str, tokens: np.ndarray, quantizer: dict,
                 n_layers: int | None) -> BlockData:
    """Check an open block file against what the lookup expects and read its layers.

    Raises CorruptBlockError for anything that is not exactly the block asked for (a FormatError
    from a damaged byte included)."""
    where = f"block {key}"
    try:
        meta = f.metadata
        if meta.get("store.key") != key or meta.get("store.parent") != parent:
            raise CorruptBlockError(f"{where}: its header names key {meta.get('store.key')!r}, "
                                    f"parent {meta.get('store.parent')!r}")
        if f.n_tokens != len(tokens):
            raise CorruptBlockError(f"{where}: holds {f.n_tokens} tokens, expected {len(tokens)}")
        stored = f.tokens()
        if stored is None or not np.array_equal(np.asarray(stored, dtype=np.int64), np.asarray(tokens, dtype=np.int64)):
            raise CorruptBlockError(f"{where}: token ids differ from the ones its key was computed from")
        if f.quantizer != quantizer:
            raise CorruptBlockError(f"{where}: quantizer differs from the store's codec")
        if n_layers is not None and len(f.layers) != n_layers:
            raise CorruptBlockError(f"{where}: {len(f.layers)} layers, the model has {n_layers}")
        for L in f.layers:
            if L.kind != "rvq" or L.n_dense_tokens != 0 or L.key_dtype not in DTYPE_BY_NAME:
                raise CorruptBlockError(f"{where}: layer {L.index} is not a plain rvq layer")
        # every layer's sections at once: side by side, and on CUDA straight into device memory
        arrays = read_arrays(f)
        out = []
        for L in f.layers:
            a = arrays[layer_key(L)]
            out.append(LayerRun(Packed(a["keys.scales"], a["keys.codes1"], a.get("keys.codes2")),
                                Packed(a["values.scales"], a["values.codes1"], a.get("values.codes2")),
                                DTYPE_BY_NAME[L.key_dtype], L.head_dim))
        return BlockData(out, f.n_tokens)
    except FormatError as e:
        raise CorruptBlockError(f"{where}: {e}") from None
    except KeyError as e:
        raise CorruptBlockError(f"{where}: section {e} missing") from None


def open_block_bytes(data: bytes, name: str):
    """Open ``.rvq`` bytes already fetched (``open_rvq`` reads bytes as a range source)."""
    del name  # the bytes carry no path; errors name the block through the caller
    return open_rvq(data)


def assemble(blocks: Sequence[BlockData], codec_header: dict, *, mode: str, use_kernels: bool = True) -> list[RVQKVCache]:
    """Concatenate blocks (in prefix order) into one RVQKVCache per layer."""
    codec = RVQCodec.from_header(codec_header, use_kernels=use_kernels)
    kw = dict(bits=codec.bits, seed=codec.seed, residual=codec.residual if codec.bits2 else "conditional",
              mode=mode, use_kernels=use_kernels)
    layers = []
    for i in range(len(blocks[0].layers)):
        runs = [b.layers[i] for b in blocks]
        layers.append((Packed.concat([r.keys for r in runs]), Packed.concat([r.values for r in runs]), runs[0]))
    # every layer's scales in one reduction; on a refusal each layer's own check raises its error
    checked = scales_pass([(codec, p.scales, run.dtype) for k, v, run in layers for p in (k, v)])
    return [RVQKVCache.from_packed(keys=(k.scales, k.codes1, k.codes2), values=(v.scales, v.codes1, v.codes2),
                                   dense_keys=None, dense_values=None, dtype=run.dtype,
                                   head_dims=(run.head_dim, run.head_dim), key_codec=codec, value_codec=codec,
                                   check_scales=not checked, **kw)
            for k, v, run in layers]


def read_block_tokens(backend, path: str) -> np.ndarray | None:
    """A block's token ids alone, checksum-verified: the preamble, the header and the token section,
    through ranged reads where the backend has them; None if the block is gone."""
    local = backend.local_path(path)
    if local is not None:
        try:
            with open_rvq(local) as f:
                ids = f.tokens()
        except FileNotFoundError:
            return None
        return None if ids is None else np.array(ids, dtype=np.int64)
    ranged = getattr(backend, "range_source", None)
    if ranged is not None:
        src = ranged(path)
        if src is None:
            return None
        with open_rvq(src) as f:
            ids = f.tokens()
        return None if ids is None else np.array(ids, dtype=np.int64)
    data = backend.get(path)
    if data is None:
        return None
    with open_block_bytes(data, path) as f:
        ids = f.tokens()
    return None if ids is None else np.array(ids, dtype=np.int64)
