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

Methods with evaluation-only codec state (sink tokens, key means) have no file form: ``None``.
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
    if m.sink or m.center_keys:
        return None
    qs = [m.plan(layer, side) for layer in range(n_layers) for side in SIDES]
    if all(q.rvq_bits is not None for q in qs):
        return "rvq"
    if all(q.affine is not None for q in qs):
        return "affine"
    return None


def _prefill(model: Any, ids: Sequence[int], caches: list) -> None:
    x = mx.array(list(ids), dtype=mx.int32)[None]
    for s in range(0, x.shape[1], 512):
        mx.eval(model(x[:, s:s + 512], cache=caches))


def rvq_bits_on_disk(model: Any, tokenizer: Any, ids: Sequence[int], m: Method,
                     modes: Sequence[str] = RVQ_MODES) -> dict[str, float]:
    """{compress mode: bits per coordinate of the saved file} for an RVQ method."""
    from rvqstore import RVQKVCache, save_prompt_cache

    n_layers = len(model.layers)
    caches = []
    for layer in range(n_layers):
        k, v = m.plan(layer, "k"), m.plan(layer, "v")
        if k.step is None and v.step is None:
            caches.append(RVQKVCache(k.rvq_bits, value_bits=v.rvq_bits))
        else:
            caches.append(_grid_cache(k.rvq_bits, v.rvq_bits, k.step, v.step))
    _prefill(model, ids, caches)
    n_coords = n_layers * len(ids) * model.args.num_key_value_heads * _head_dim(model) * 2
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in modes:
            path = os.path.join(d, f"{mode}.rvq")
            size = save_prompt_cache(path, caches, tokens=ids, model=model, tokenizer=tokenizer,
                                     compress="auto" if mode == ESTIMATED_BEST else mode)
            if size != os.path.getsize(path):
                raise RuntimeError("save_prompt_cache's returned size is not the file's")
            out[mode] = (best_from_auto(path) if mode == ESTIMATED_BEST else size) * 8 / n_coords
    return out


def _grid_cache(key_bits, value_bits, key_step, value_step):
    """An RVQKVCache on uniform grids: ``RVQKVCache(step=, value_step=)`` where the library has it,
    else (while the cache's own plumbing lands) one whose two codecs are built with the steps."""
    import inspect

    from rvqstore import RVQCodec, RVQKVCache

    if "value_step" in inspect.signature(RVQKVCache.__init__).parameters:
        return RVQKVCache(key_bits, value_bits=value_bits, step=key_step, value_step=value_step)

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
    import numpy as np
    import zstandard

    from rvqstore.format.writer import AUTO_MIN_SAVING, ZSTD_LEVEL

    raw = np.asarray(a).tobytes()
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
