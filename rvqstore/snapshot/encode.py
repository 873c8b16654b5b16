"""Caches -> ``.rvq`` layer maps and sections (names from docs/design-format-1.1.md and 1.2).

One layer map per top-level cache: ``rvq`` (RVQKVCache; with codec state its ``sink_tokens`` /
``center_keys`` and ``keys.sink`` / ``values.sink`` / ``keys.mean`` sections), ``rvq-rotating`` (RVQRotatingKVCache: the
window in temporal order + max_size/keep/offset), ``arrays`` (mlx-lm ArraysCache: one ``state.<k>``
section per filled slot) and ``list`` (CacheList: child maps, sections prefixed ``c<j>.``).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from ..cache import RVQKVCache
from ..compat import UnsupportedCacheError
from ..errors import RVQError
from ..format import Section
from ..rotating_cache import RVQRotatingKVCache


def dtype_name(dt: mx.Dtype) -> str:
    return str(dt).split(".")[-1]


def _lm():
    from mlx_lm.models import cache as lm

    return lm


def seen_tokens(c: Any) -> int | None:
    """Tokens an attention cache has seen (None for recurrent state, which does not count them)."""
    if isinstance(c, (RVQKVCache, RVQRotatingKVCache)):
        return c.offset
    if isinstance(c, _lm().CacheList):
        counts = {n for n in (seen_tokens(x) for x in c.caches) if n is not None}
        return counts.pop() if len(counts) == 1 else (None if not counts else -1)
    return None


def is_empty(c: Any) -> bool:
    if isinstance(c, _lm().CacheList):
        return any(is_empty(x) for x in c.caches)
    return c.empty()


class _Quantizers:
    """Distinct codec maps in first-use order: one means the 1.0 top-level ``quantizer``, more a table."""

    def __init__(self) -> None:
        self.maps: list[dict] = []

    def index(self, codec) -> int:
        h = codec.to_header()
        if h not in self.maps:
            self.maps.append(h)
        return self.maps.index(h)


class LayerEncoder:
    """Builds the layer maps and sections of one snapshot."""

    def __init__(self, n_tokens: int) -> None:
        self.n_tokens = n_tokens
        self.quantizers = _Quantizers()
        self.sections: list[Section] = []
        self._layer_quant: list[tuple[dict, Any, Any]] = []  # (layer map, key codec idx, value codec idx)

    def _add(self, layer: int, prefix: str, kind: str, arr: Any) -> None:
        self.sections.append(Section(f"layers.{layer}.{prefix}{kind}", layer, f"{prefix}{kind}", arr))

    def _attention(self, c: Any, m: dict, layer: int, prefix: str) -> dict:
        b, h, dk, dv = c.geometry
        m.update({"batch": b, "n_kv_heads": h, "head_dim": dk, "value_head_dim": dv,
                  "key_dtype": dtype_name(c.dtype), "value_dtype": dtype_name(c.dtype)})
        self._layer_quant.append((m, self.quantizers.index(c._keys.codec), self.quantizers.index(c._values.codec)))
        for side, stream in (("keys", c._keys), ("values", c._values)):
            scales, codes1, codes2 = stream.used()
            self._add(layer, prefix, f"{side}.codes1", codes1)
            if codes2 is not None:
                self._add(layer, prefix, f"{side}.codes2", codes2)
            self._add(layer, prefix, f"{side}.scales", scales)
        return m

    def _codec_state(self, c: RVQKVCache, m: dict, layer: int, prefix: str, where: str) -> dict:
        """Sink positions and key mean (format 1.2, feature codec-state); nothing for a cache without
        them, so its file stays byte for byte what it was."""
        if c.sink_tokens:
            m["sink_tokens"] = c.sink_tokens
        if c.center_keys:
            m["center_keys"] = True
        if c.n_sink:
            self._add(layer, prefix, "keys.sink", c.sink_keys)
            self._add(layer, prefix, "values.sink", c.sink_values)
        if c.center_keys and c.n_coded:  # the file holds a mean exactly beside coded keys
            if c.key_mean is None:
                raise RVQError(f"{where}: a centering cache with {c.n_coded} coded tokens holds no key mean")
            self._add(layer, prefix, "keys.mean", c.key_mean)
        return m

    def layer_map(self, c: Any, index: int, layer: int, prefix: str, where: str) -> dict:
        lm = _lm()
        if isinstance(c, RVQKVCache):
            m = self._attention(c, {"index": index, "kind": "rvq", "n_tokens": c.offset,
                                    "n_dense_tokens": c.n_dense}, layer, prefix)
            if c.n_dense:
                self._add(layer, prefix, "keys.dense", c._dense_k)
                self._add(layer, prefix, "values.dense", c._dense_v)
            return self._codec_state(c, m, layer, prefix, where)
        if isinstance(c, RVQRotatingKVCache):
            return self._attention(c, {"index": index, "kind": "rvq-rotating", "n_tokens": c.n_held,
                                       "n_dense_tokens": 0, "max_size": c.max_size, "keep": c.keep,
                                       "offset": c.offset}, layer, prefix)
        if isinstance(c, lm.ArraysCache):
            if c.left_padding is not None or c.lengths is not None:
                raise UnsupportedCacheError(f"{where}: an ArraysCache prepared for batched generation (left_padding/"
                                            f"lengths set) cannot be saved; a snapshot holds one prompt")
            for k, a in enumerate(c.cache):
                if a is not None:
                    self._add(layer, prefix, f"state.{k}", a)
            return {"index": index, "kind": "arrays", "n_tokens": self.n_tokens, "n_arrays": len(c.cache)}
        if isinstance(c, lm.CacheList) and not prefix:
            children = [self.layer_map(x, j, layer, f"c{j}.", f"{where}, child {j}") for j, x in enumerate(c.caches)]
            return {"index": index, "kind": "list", "n_tokens": self.n_tokens, "children": children}
        raise UnsupportedCacheError(f"{where}: cannot save a {type(c).__name__} (convert the cache with "
                                    f"rvqstore.convert_prompt_cache first)")

    def finish(self, layers: list[dict]) -> dict:
        """The header's quantizer keys: ``quantizer`` when one codec serves every side, else a table."""
        if len(self.quantizers.maps) <= 1:
            return {"quantizer": self.quantizers.maps[0] if self.quantizers.maps else None}
        for m, ki, vi in self._layer_quant:
            m["key_quantizer"], m["value_quantizer"] = ki, vi
        return {"quantizer": None, "quantizers": list(self.quantizers.maps)}


def snapshot_token_count(caches: Sequence[Any], tokens_len: int | None) -> int:
    """The token count every layer agrees on (attention layers count theirs; recurrent ones cannot)."""
    counts = {}
    for i, c in enumerate(caches):
        n = seen_tokens(c)
        if n == -1:
            raise RVQError(f"layer {i}: the caches of this CacheList hold different token counts")
        if n is not None:
            counts.setdefault(n, i)
    if len(counts) > 1:
        raise RVQError(f"layers hold different token counts {sorted(counts)}")
    if counts:
        return next(iter(counts))
    if tokens_len is None:
        raise RVQError("only recurrent-state layers: pass tokens= so the snapshot knows how many tokens it holds")
    return tokens_len


def encode_snapshot(caches: Sequence[Any], n_tokens: int) -> tuple[list[dict], list[Section], dict]:
    """(layer maps, layer sections, quantizer header keys) of ``caches``."""
    enc = LayerEncoder(n_tokens)
    layers = [enc.layer_map(c, i, i, "", f"layer {i}") for i, c in enumerate(caches)]
    return layers, enc.sections, enc.finish(layers)
