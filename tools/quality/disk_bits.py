"""Bits per coordinate ON DISK, measured: the cached half of a text saved as a real file.

RVQ methods (Lloyd–Max or uniform-grid tables): the first half of the text is prefilled through the model into real
:class:`rvqstore.RVQKVCache` caches with the method's bits per (layer, side), and
:func:`rvqstore.save_prompt_cache` writes them (token ids and model fingerprint included, as
``rvqstore cache-prompt`` does) with each compress mode; the figure is file bytes x 8 / (tokens x
layers x kv heads x head dim x 2 sides): everything counted.

Affine baselines (mlx-lm ``mx.quantize``, plain or after the Hadamard rotation): the keys and values
the model hands its cache under that method are quantized as the method does, and counted as mlx-lm
keeps them: packed uint32 codes + float16 scales + float16 biases per (layer, side). ``raw`` is their
bytes; ``zstd`` compresses each array on its own with the same zstd level and the same keep-if-it-
saves->=2% rule as the ``.rvq`` writer's ``auto`` mode (like for like with our ``auto`` files; the
file container around them, e.g. a safetensors header, is not counted: that favours the baseline);
``best`` gives the codes the smaller of that and the size our rANS coder would reach on them (one
frequency table per head-dim column, :func:`rans_size`: like for like with our ``best`` files).

Methods with codec state (``Method.sink`` tokens kept exact, ``Method.center_keys``: a per-head key mean,
docs/design: format 1.2 ``codec-state``) are saved by caches that hold that state
(``RVQKVCache(sink_tokens=, center_keys=)``) where the library has it. Before it did, their size was
**estimated** (:func:`state_estimate`): the file of the coded tokens alone (the keys and values the
method's own prefill hands the cache, less the sink tokens, keys less the mean) plus the state's sections
as the writer stores them (bytes, zstd rule, alignment, header entries, layer keys). ``state_measured``
says which one a figure is; the evaluation keeps the two apart (they are stored under different keys).
"""

from __future__ import annotations

import math
import os

import numpy as np
import tempfile
from typing import Any, Sequence

import mlx.core as mx

from .methods import SIDES, Method
from .protocol import SimCache

RVQ_MODES = ("none", "auto", "best")  # save_prompt_cache compress modes measured ("best" adds rANS: slow)
# "best~": the "best" file's size estimated from the "auto" file (best_from_auto), for fitting steps fast
ESTIMATED_BEST = "best~"
AFFINE_MODES = ("raw", "zstd", "best")
# what a mode of ours compares with, like for like
LIKE = {"none": "raw", "auto": "zstd", "best": "best"}


def file_form(m: Method, n_layers: int) -> str | None:
    """"rvq", "affine" or None (no saved form)."""
    qs = [m.plan(layer, side) for layer in range(n_layers) for side in SIDES]
    if all(q.rvq_bits is not None for q in qs):
        return "rvq"
    if all(q.affine is not None for q in qs) and not (m.sink or m.center_keys):
        return "affine"
    return None


def _prefill(model: Any, ids: Sequence[int], caches: list) -> None:
    x = mx.array(list(ids), dtype=mx.int32)[None]
    for s in range(0, x.shape[1], 512):
        mx.eval(model(x[:, s:s + 512], cache=caches))


def has_state(m: Method) -> bool:
    return bool(m.sink or m.center_keys)


def cache_holds_state() -> bool:
    """True when ``RVQKVCache`` takes ``sink_tokens`` / ``center_keys`` (the codec-state feature)."""
    import inspect

    from rvqstore import RVQKVCache

    params = inspect.signature(RVQKVCache.__init__).parameters
    return "sink_tokens" in params and "center_keys" in params


def state_measured(m: Method) -> bool:
    """Whether ``m``'s file sizes are real files (False: :func:`state_estimate`)."""
    return not has_state(m) or cache_holds_state()


def _cache_for(m: Method, layer: int, **state: Any):
    from rvqstore import RVQKVCache

    k, v = m.plan(layer, "k"), m.plan(layer, "v")
    if k.step is None and v.step is None:
        return RVQKVCache(k.rvq_bits, value_bits=v.rvq_bits, **state)
    return _grid_cache(k.rvq_bits, v.rvq_bits, k.step, v.step, **state)


def _save_sizes(path_dir: str, caches: list, ids: Sequence[int], model: Any, tokenizer: Any,
                modes: Sequence[str]) -> dict[str, int]:
    """{mode: file bytes} of ``caches`` saved with each compress mode (ESTIMATED_BEST: from "auto")."""
    from rvqstore import save_prompt_cache

    out = {}
    for mode in modes:
        path = os.path.join(path_dir, f"{mode}.rvq")
        size = save_prompt_cache(path, caches, tokens=ids, model=model, tokenizer=tokenizer,
                                 compress="auto" if mode == ESTIMATED_BEST else mode)
        if size != os.path.getsize(path):
            raise RuntimeError("save_prompt_cache's returned size is not the file's")
        out[mode] = best_from_auto(path) if mode == ESTIMATED_BEST else size
    return out


def rvq_bits_on_disk(model: Any, tokenizer: Any, ids: Sequence[int], m: Method,
                     modes: Sequence[str] = RVQ_MODES) -> dict[str, float]:
    """{compress mode: bits per coordinate of the saved file} for an RVQ method (with codec state: the
    real file where the cache holds state, else :func:`state_estimate`)."""
    n_layers = len(model.layers)
    n_coords = n_layers * len(ids) * model.args.num_key_value_heads * _head_dim(model) * 2
    if has_state(m) and not cache_holds_state():
        return {mode: b * 8 / n_coords for mode, b in state_estimate(model, tokenizer, ids, m, modes).items()}
    state = {"sink_tokens": m.sink, "center_keys": m.center_keys} if has_state(m) else {}
    caches = [_cache_for(m, layer, **state) for layer in range(n_layers)]
    _prefill(model, ids, caches)
    with tempfile.TemporaryDirectory() as d:
        return {mode: b * 8 / n_coords for mode, b in _save_sizes(d, caches, ids, model, tokenizer, modes).items()}


# what the state adds to a layer's header map: "center_keys": true, "sink_tokens": S (msgpack), and the
# feature's name once in required_features
_STATE_LAYER_KEYS = {"center_keys": True, "sink_tokens": 1}
STATE_FEATURE = "codec-state"


def _entry_bytes(name: str, layer: int, kind: str, dtype: str, shape: list[int], length: int, codec: str) -> int:
    """Bytes a section's row adds to the msgpack header (as the writer builds it)."""
    from rvqstore.format.header import encode_header

    row = {"name": name, "layer": layer, "kind": kind, "dtype": dtype, "shape": shape, "offset": 2 ** 31,
           "length": length, "codec": codec, "raw_length": length, "checksum": 2 ** 63}
    return len(encode_header({"sections": [row, row]})) - len(encode_header({"sections": [row]}))


def state_sections_bytes(arrays: dict[str, np.ndarray], layer: int) -> int:
    """Bytes the state sections of one layer add to a file: each array stored as the writer's auto rule
    stores it (zstd frame when it saves >= 2%), its 64-byte alignment (half of it, on average), its
    header row, and the layer map's two keys."""
    from rvqstore.format.header import encode_header

    total = len(encode_header(_STATE_LAYER_KEYS)) - 1  # the map's own prefix is already there
    for kind, a in arrays.items():
        stored = _zstd_np(a)
        codec = "zstd" if stored < a.nbytes else "raw"
        total += stored + 32 + _entry_bytes(f"layers.{layer}.{kind}", layer, kind, str(a.dtype), list(a.shape),
                                            stored, codec)
    return total


def state_estimate(model: Any, tokenizer: Any, ids: Sequence[int], m: Method,
                   modes: Sequence[str] = RVQ_MODES) -> dict[str, int]:
    """{mode: bytes} of the file a cache with ``m``'s state would write, before the cache held state:
    the method's own prefill (the simulated cache: what the model hands each layer's cache) captured;
    per layer, a stateless cache of the method's codecs fed the coded tokens exactly as the state cache
    codes them (the first ``m.sink`` positions left out, keys less the layer's float16 key mean) and
    saved (token ids of the coded positions); plus the sink positions' ids (int32), the state sections
    (:func:`state_sections_bytes`: keys.sink / values.sink float16 ``(B, H, S, D)``, keys.mean float16
    ``(B, H, D)``) and the feature's name. Checked against real files: docs/quality.md."""
    from rvqstore.format.header import encode_header

    n_layers = len(model.layers)
    seen = [_Capture(layer, m) for layer in range(n_layers)]
    _prefill(model, ids, seen)
    s = min(m.sink, len(ids))
    caches, extra = [], 4 * s + len(encode_header([STATE_FEATURE])) - 1
    for layer, c in enumerate(seen):
        k = mx.concatenate(c.seen["k"], axis=2).astype(mx.float32)
        v = mx.concatenate(c.seen["v"], axis=2).astype(mx.float32)
        body_k = k[:, :, s:] - c.key_mean if m.center_keys else k[:, :, s:]
        cache = _cache_for(m, layer)
        mx.eval(cache.update_and_fetch(body_k, v[:, :, s:]))
        caches.append(cache)
        state = {}
        if s:
            state["keys.sink"] = np.asarray(k[:, :, :s].astype(mx.float16))
            state["values.sink"] = np.asarray(v[:, :, :s].astype(mx.float16))
        if m.center_keys:
            state["keys.mean"] = np.asarray(c.key_mean[:, :, 0].astype(mx.float16))
        extra += state_sections_bytes(state, layer)
    with tempfile.TemporaryDirectory() as d:
        return {mode: b + extra for mode, b in _save_sizes(d, caches, list(ids)[s:], model, tokenizer, modes).items()}


def _grid_cache(key_bits, value_bits, key_step, value_step, **state):
    """An RVQKVCache on uniform grids: ``RVQKVCache(step=, value_step=)`` where the library has it,
    else (while the cache's own plumbing lands) one whose two codecs are built with the steps."""
    import inspect

    from rvqstore import RVQCodec, RVQKVCache

    if "value_step" in inspect.signature(RVQKVCache.__init__).parameters:
        return RVQKVCache(key_bits, value_bits=value_bits, step=key_step, value_step=value_step, **state)

    class GridCache(RVQKVCache):
        def _codec(self, dim, bits=None):  # bits None: the key codec (RVQKVCache._init_geometry)
            b, st = (key_bits, key_step) if bits is None else (value_bits, value_step)
            return RVQCodec(dim, b, self.seed, self.residual, use_kernels=self.use_kernels, step=st)

    return GridCache(key_bits, value_bits=value_bits)


def rans_estimate(words: np.ndarray, bits: int, dim: int) -> int:
    """Bytes of the writer's ``rans`` form of a packed code section, from its histogram (no coding):
    the smaller of one table per coordinate and one table; the ideal code length under the spec's
    quantized frequencies, plus the fixed header, the tables and the lanes' final states. Against
    ``rans.encode`` on SmolLM2 sections: within +-0.05% (tests/test_eval_quality.py), at 1/300 of the time."""
    from rvqstore.format import rans

    return rans_size(rans.unpack(words, bits, dim), bits)


def rans_size(codes: np.ndarray, bits: int) -> int:
    """:func:`rans_estimate` of codes ``(vectors, dim)`` of ``bits`` bits (also wider than the format's
    4: the affine baselines' 5-bit codes get the same coder's size)."""
    from rvqstore.format import rans

    return min(rans.estimated_size(codes, bits, contexts) for contexts in (1, 0))


def best_from_auto(path: str) -> int:
    """File bytes with ``compress="best"`` estimated from the same cache saved with ``"auto"``: each
    packed code section takes the smaller of its stored bytes and :func:`rans_estimate` (``best`` keeps
    the smallest of raw, zstd and rans per section; raw/zstd are what ``auto`` already chose)."""
    from rvqstore.format.reader import open_rvq

    saved = 0
    with open_rvq(path) as f:
        layers = {li.index: li for li in f.layers}
        for s in f.sections:
            parts = s.kind.split(".")
            if s.dtype != "uint32" or len(parts) != 2 or parts[1] not in ("codes1", "codes2"):
                continue
            q = f.header.quantizer_for(layers[s.layer], parts[0])
            bits = q["bits1"] if parts[1] == "codes1" else q["bits2"]
            est = rans_estimate(np.asarray(f.read_section(s.name)).view("<u4").reshape(-1), bits, q["dim"])
            saved += max(0, s.length - est)
    return os.path.getsize(path) - saved


class _Capture(SimCache):
    """A SimCache that also keeps what it is handed (the method's own prefill)."""

    def __init__(self, layer: int, method: Method):
        super().__init__(layer, method)
        self.seen = {"k": [], "v": []}

    def update_and_fetch(self, keys, values):
        self.seen["k"].append(keys)
        self.seen["v"].append(values)
        return super().update_and_fetch(keys, values)


def _zstd_bytes(a: mx.array) -> int:
    """Bytes of one array under the writer's auto rule: a zstd frame where it saves >= 2 %, else raw."""
    return _zstd_np(np.asarray(a))


def _zstd_np(a: np.ndarray) -> int:
    import zstandard

    from rvqstore.format.writer import AUTO_MIN_SAVING, ZSTD_LEVEL

    raw = a.tobytes()
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True, write_checksum=False).compress(raw)
    return len(frame) if len(frame) <= (1.0 - AUTO_MIN_SAVING) * len(raw) else len(raw)


def affine_bits_on_disk(model: Any, ids: Sequence[int], m: Method) -> dict[str, float]:
    """{"raw", "zstd", "best"}: bits per coordinate of an affine method's stored arrays."""
    n_layers = len(model.layers)
    caches = [_Capture(layer, m) for layer in range(n_layers)]
    _prefill(model, ids, caches)
    raw = packed = best = n_coords = 0
    for c in caches:
        for side in SIDES:
            bits, group, rotated = m.plan(c.layer, side).affine
            x = mx.concatenate(c.seen[side], axis=2).astype(mx.float32)
            dim = x.shape[-1]
            if rotated:
                x = mx.hadamard_transform(x, scale=1.0 / math.sqrt(dim))
            arrays = mx.quantize(x.astype(mx.float16), group_size=group, bits=bits)
            mx.eval(*arrays)
            raw += sum(a.nbytes for a in arrays)
            packed += sum(_zstd_bytes(a) for a in arrays)
            codes = _affine_codes(arrays[0], bits, dim)
            best += min(_zstd_bytes(arrays[0]), rans_size(codes, bits)) + sum(_zstd_bytes(a) for a in arrays[1:])
            n_coords += x.size
    return {"raw": raw * 8 / n_coords, "zstd": packed * 8 / n_coords, "best": best * 8 / n_coords}


def _affine_codes(packed: mx.array, bits: int, dim: int) -> np.ndarray:
    """mx.quantize's codes ``(vectors, dim)``: its uint32 words are one little-endian bit stream per row."""
    w = np.asarray(packed).reshape(-1, packed.shape[-1]).view(np.uint8)
    b = np.unpackbits(w, axis=1, bitorder="little")[:, :dim * bits].reshape(-1, dim, bits)
    return (b.astype(np.int64) << np.arange(bits)).sum(-1)


def _head_dim(model: Any) -> int:
    attn = model.layers[0].self_attn
    return getattr(attn, "head_dim", None) or attn.k_proj.weight.shape[0] // model.args.num_key_value_heads


def bits_on_disk(model: Any, tokenizer: Any, ids: Sequence[int], m: Method,
                 rvq_modes: Sequence[str] = ("none", "auto")) -> dict[str, float] | None:
    """Bits per coordinate on disk of ``m`` storing the cache of ``ids`` (None: no file form)."""
    form = file_form(m, len(model.layers))
    if form == "rvq":
        return rvq_bits_on_disk(model, tokenizer, ids, m, rvq_modes)
    if form == "affine":
        return affine_bits_on_disk(model, ids, m)
    return None


def summarize_disk(per_text: dict[str, dict[str, float]], tuning: Sequence[str]) -> dict:
    """A row's on-disk figures: per text, and the mean and the max over the tuning texts, by mode
    (modes measured on every tuning text only)."""
    modes = [x for x in next(iter(per_text.values())) if all(x in per_text.get(t, {}) for t in tuning)]
    out: dict = {"texts": per_text}
    if tuning and modes:
        out["pooled"] = {x: sum(per_text[t][x] for t in tuning) / len(tuning) for x in modes}
        out["max"] = {x: max(per_text[t][x] for t in tuning) for x in modes}
    return out


def on_disk(row: dict, mode: str = "auto", text: str | None = None, stat: str = "pooled") -> float | None:
    """A row's on-disk bits in ``mode`` of ours, or the like-for-like mode of an affine row
    (``text``: that text's; else ``stat`` over the tuning texts)."""
    d = row.get("disk")
    if not d:
        return None
    src = d["texts"].get(text, {}) if text else d.get(stat, {})
    return src.get(mode, src.get(LIKE.get(mode, mode)))
