"""Saving, loading and resuming prompt caches as ``.rvq`` files.

``save_prompt_cache`` writes only the used tokens of each layer (codes, scales, and any
full-precision window), the prompt's token ids and, given the model, its fingerprint.
``load_prompt_cache`` rebuilds the caches bit for bit and refuses a file made for another model.
``resume`` finds the longest common prefix between a new prompt and the stored tokens and returns the
caches trimmed to it, with the tokens still to compute.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from .cache import RVQKVCache
from .cache_kinds import convert_caches, make_caches
from .codec import DEFAULT_BITS, RVQCodec
from .compat import UnsupportedCacheError
from .errors import RVQError
from .format import MalformedHeaderError, Section, open_rvq, write_rvq

_DTYPE_BY_NAME = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_FP_IGNORED = {"source"}  # labels, not identity


class ModelMismatchError(RVQError, ValueError):
    """A snapshot was made with a different model (architecture, geometry, weights or vocabulary)."""


class NoTokensError(RVQError, ValueError):
    """A snapshot without token ids cannot be resumed by prefix."""


# id(model) -> (weakref to the model, weakrefs to its parameter arrays and to the tokenizer,
# fingerprint). model_fingerprint hashes every weight (0.3-0.6 s for SmolLM2-135M on a 2-core CPU,
# more than the whole resume of a 4096-token snapshot), which would otherwise be paid again on every
# save, load and resume. (Keyed by id: mlx modules are dicts, hence not hashable.)
_FP_MEMO: dict[int, tuple] = {}


def _fingerprint(model: Any, tokenizer: Any) -> dict:
    """``model_fingerprint(model, tokenizer)``, computed once per model while its parameters stay the same.

    The memo is reused only while ``model`` holds the very same parameter array objects (names and
    identities) and the same tokenizer object. Replacing weights by any mlx API (``load_weights``,
    ``update``, ``set_dtype``, quantizing, assigning a new array to an attribute) makes new arrays, so
    the next call hashes again; only in-place item assignment into a parameter (``w[0] = x``) keeps
    the object and goes unnoticed.
    """
    from mlx.utils import tree_flatten

    from .model import model_fingerprint

    params = tree_flatten(model.parameters())
    hit = _FP_MEMO.get(id(model))
    if hit is not None:
        model_ref, refs, tok_ref, fp = hit
        if (model_ref() is model and len(refs) == len(params)
                and (tok_ref() if tok_ref is not None else None) is tokenizer
                and all(n == rn and r() is a for (n, a), (rn, r) in zip(params, refs))):
            return dict(fp)
    fp = model_fingerprint(model, tokenizer)
    try:
        key = id(model)
        model_ref = weakref.ref(model, lambda _, key=key: _FP_MEMO.pop(key, None))
        refs = [(n, weakref.ref(a)) for n, a in params]
        tok_ref = None if tokenizer is None else weakref.ref(tokenizer)
    except TypeError:  # something not weak-referenceable: no memo
        return fp
    _FP_MEMO[key] = (model_ref, refs, tok_ref, dict(fp))
    return fp


def _dtype_name(dt: mx.Dtype) -> str:
    return str(dt).split(".")[-1]


def _as_rvq_caches(cache: Sequence[Any], codec_kwargs: dict) -> list[RVQKVCache]:
    out = []
    for i, c in enumerate(cache):
        if isinstance(c, RVQKVCache):
            out.append(c)
        else:
            try:
                out.append(RVQKVCache.from_kv_cache(c, **codec_kwargs))
            except UnsupportedCacheError as e:
                raise UnsupportedCacheError(f"layer {i}: {e}") from None
    return out


def _check_layer_count(n: int, model: Any, where: str) -> None:
    if n != len(model.layers):
        raise ModelMismatchError(f"{where}: {n} layers, but the model has {len(model.layers)}")


def save_prompt_cache(path: str | os.PathLike, cache: Sequence[Any], *, tokens: Sequence[int] | None = None,
                      metadata: dict[str, str] | None = None, model: Any = None, tokenizer: Any = None,
                      bits: tuple[int, int] = DEFAULT_BITS, seed: int = 0, residual: str = "conditional",
                      compress: str = "auto", progress: Callable[[int, int | None], None] | None = None) -> int:
    """Write ``cache`` (a list, one entry per layer) to ``path`` as an ``.rvq`` snapshot.

    Entries may be :class:`RVQKVCache` or mlx-lm ``KVCache`` / ``QuantizedKVCache`` (these are encoded
    with ``bits``/``seed``/``residual``). ``tokens``: the ids the cache holds (needed for
    :func:`resume`; their count must equal the cache's offset). ``model`` (and ``tokenizer``): store
    their fingerprint so loading into another model is refused. The write is atomic: an interrupted
    save leaves any previous file at ``path`` untouched. Returns the file size in bytes.
    """
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map str to str")
    caches = _as_rvq_caches(cache, dict(bits=bits, seed=seed, residual=residual))
    if not caches or any(c.empty() for c in caches):
        raise RVQError("cannot save an empty cache (run the prompt through the model first)")
    first = caches[0]
    offsets = {c.offset for c in caches}
    if len(offsets) != 1:
        raise RVQError(f"layers hold different token counts {sorted(offsets)}")
    n_tokens = first.offset
    if tokens is not None:
        tokens = np.asarray(list(tokens), dtype=np.int64)
        if tokens.ndim != 1 or len(tokens) != n_tokens:
            raise ValueError(f"tokens has {tokens.size} ids but the cache holds {n_tokens} tokens")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**31):
            raise ValueError("token ids must be in [0, 2^31)")
    settings = {(c.codec_bits, c.seed, c.residual) for c in caches}
    if len(settings) != 1:
        raise RVQError("all layers must share one codec setting (bits, seed, residual) in format v1")
    dims = {c.geometry[2:] for c in caches}
    if len(dims) != 1 or len(next(iter(dims))) != 2 or len(set(next(iter(dims)))) != 1:
        raise UnsupportedCacheError(f"format v1 needs one head dim shared by keys and values, got {sorted(dims)}")
    fingerprint = None
    if model is not None:
        _check_layer_count(len(caches), model, "the cache")
        fingerprint = _fingerprint(model, tokenizer)

    codec = first._keys.codec
    layers, sections = [], []
    if tokens is not None:
        sections.append(Section("tokens", -1, "tokens", tokens.astype(np.int32)))
    for i, c in enumerate(caches):
        b, h, d, _ = c.geometry
        layers.append({"index": i, "kind": "rvq", "batch": b, "n_kv_heads": h, "head_dim": d,
                       "n_tokens": c.offset, "n_dense_tokens": c.n_dense,
                       "key_dtype": _dtype_name(c.dtype), "value_dtype": _dtype_name(c.dtype)})
        for side, stream, dense in (("keys", c._keys, c._dense_k), ("values", c._values, c._dense_v)):
            scales, codes1, codes2 = stream.used()
            sections.append(Section(f"layers.{i}.{side}.codes1", i, f"{side}.codes1", codes1))
            if codes2 is not None:
                sections.append(Section(f"layers.{i}.{side}.codes2", i, f"{side}.codes2", codes2))
            sections.append(Section(f"layers.{i}.{side}.scales", i, f"{side}.scales", scales))
            if c.n_dense:
                sections.append(Section(f"layers.{i}.{side}.dense", i, f"{side}.dense", dense))
    header = {
        "n_tokens": n_tokens,
        "layers": layers,
        "quantizer": codec.to_header(),
        "model": fingerprint,
        "metadata": dict(metadata or {}),
        "cache": {"mode": first.mode, "dense_window": first.dense_window, "flush_block": first.flush_block},
    }
    write_rvq(path, header, sections, compress=compress, progress=progress)
    return os.path.getsize(path)


def check_model(file_fp: dict | None, model: Any, tokenizer: Any = None, *, path: str = "") -> None:
    """Raise ModelMismatchError if the snapshot's fingerprint differs from ``model``'s (and tokenizer's)."""
    if file_fp is None:
        return
    mine = _fingerprint(model, tokenizer)  # without a tokenizer: no vocab hash to compare
    diff = [k for k in file_fp if k not in _FP_IGNORED and k in mine and file_fp[k] != mine[k]]
    if diff:
        detail = ", ".join(f"{k}: file {file_fp[k]!r} vs model {mine[k]!r}" for k in diff[:4])
        raise ModelMismatchError(f"{path}: snapshot was made with a different model ({detail})")


def _check_file_against_model(f, model: Any, tokenizer: Any) -> None:
    check_model(f.model, model, tokenizer, path=f.path)
    _check_layer_count(len(f.layers), model, f.path)


def _cache_options(f) -> dict:
    """The snapshot's ``cache`` extension map (mode, window), validated: a crafted header must not
    reach the cache constructor as arbitrary types."""
    opts = f.header.raw.get("cache") or {}
    ok = isinstance(opts, dict) and opts.get("mode", "packed") in ("packed", "resident") and all(
        type(opts.get(k, 1)) is int and opts.get(k, 1) >= lo for k, lo in (("dense_window", 0), ("flush_block", 1)))
    if not ok:
        raise MalformedHeaderError(f.path, f"header.cache is malformed: {opts!r}"[:300])
    return {"mode": opts.get("mode", "packed"), "dense_window": opts.get("dense_window", 0),
            "flush_block": opts.get("flush_block", 64)}


def load_prompt_cache(path: str | os.PathLike, *, model: Any = None, tokenizer: Any = None,
                      return_metadata: bool = False, mode: str | None = None, use_kernels: bool = True):
    """Load an ``.rvq`` snapshot as a list of :class:`RVQKVCache` (one per layer).

    With ``model`` (and ``tokenizer``), a snapshot whose fingerprint differs is refused with
    :class:`ModelMismatchError`. ``mode`` overrides the stored cache mode (``"packed"``/``"resident"``).
    With ``return_metadata`` returns ``(caches, metadata)``.
    """
    with open_rvq(path) as f:
        if model is not None:
            _check_file_against_model(f, model, tokenizer)
        caches = _read_caches(f, mode=mode, use_kernels=use_kernels)
        meta = dict(f.metadata)
    return (caches, meta) if return_metadata else caches


def _read_caches(f, *, mode: str | None, use_kernels: bool) -> list[RVQKVCache]:
    if f.quantizer is None:
        raise RVQError(f"{f.path}: no quantizer in this file")
    codec = RVQCodec.from_header(f.quantizer, use_kernels=use_kernels)
    opts = _cache_options(f)
    kw = dict(bits=codec.bits, seed=codec.seed, residual=codec.residual if codec.bits2 else "conditional",
              mode=mode or opts["mode"], dense_window=opts["dense_window"], flush_block=opts["flush_block"],
              use_kernels=use_kernels)
    caches = []
    for layer in f.layers:
        if layer.kind != "rvq":
            raise RVQError(f"{f.path}: layer {layer.index} is {layer.kind!r}; this version loads rvq layers only")
        if layer.head_dim != codec.dim:
            raise RVQError(f"{f.path}: layer {layer.index} head dim {layer.head_dim} != quantizer dim {codec.dim}")
        a = f.layer_arrays(layer.index, as_mx=True)
        caches.append(RVQKVCache.from_packed(
            keys=(a["keys.scales"], a["keys.codes1"], a.get("keys.codes2")),
            values=(a["values.scales"], a["values.codes1"], a.get("values.codes2")),
            dense_keys=a.get("keys.dense"), dense_values=a.get("values.dense"),
            dtype=_DTYPE_BY_NAME[layer.key_dtype], head_dims=(layer.head_dim, layer.head_dim),
            key_codec=codec, value_codec=codec, **kw))
    return caches


@dataclass
class ResumeResult:
    """What :func:`resume` found: caches trimmed to the reused prefix and the tokens left to compute."""

    cache: list[RVQKVCache]
    reused: int  # prompt tokens whose keys/values come from the file
    remaining: list[int]  # prompt tokens still to run through the model (never empty)
    stored: int  # tokens the file held
    metadata: dict[str, str] = field(default_factory=dict)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def resume(path: str | os.PathLike, prompt_tokens: Sequence[int], model: Any = None, *, tokenizer: Any = None,
           mode: str | None = None, use_kernels: bool = True) -> ResumeResult:
    """Reuse the longest common prefix of ``prompt_tokens`` with the snapshot's tokens.

    At least one prompt token is always left to compute (the model needs it to produce logits), so a
    prompt equal to the stored tokens reuses all but its last token.
    """
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise ValueError("prompt_tokens is empty")
    with open_rvq(path) as f:
        stored = f.tokens()
        if stored is None:
            raise NoTokensError(f"{os.fspath(path)}: the snapshot stores no token ids, so no prefix can be matched")
        if model is not None:
            _check_file_against_model(f, model, tokenizer)
        p = min(common_prefix_length(stored, prompt), len(prompt) - 1)
        caches = _read_caches(f, mode=mode, use_kernels=use_kernels)
        meta = dict(f.metadata)
        n_stored = len(stored)
    for c in caches:
        c.trim(c.offset - p)
    return ResumeResult(caches, p, prompt[p:], n_stored, meta)


def make_prompt_cache(model: Any, bits: tuple[int, int] | int = DEFAULT_BITS, seed: int = 0, residual: str = "conditional",
                      **kwargs: Any) -> list:
    """rvqstore caches following the model's own per-layer cache kinds (``model.make_cache()``).

    Plain layers get an :class:`RVQKVCache`, sliding-window layers an :class:`RVQRotatingKVCache` (same
    ``max_size``/``keep``), recurrent state (``ArraysCache``) stays as mlx-lm makes it, and a
    ``CacheList`` gets its children converted; any other kind raises :class:`UnsupportedCacheError`
    naming it and the layer (see :mod:`rvqstore.cache_kinds`). ``kwargs`` go to the RVQ caches
    (``mode``, ``dense_window``, ...; sliding-window layers take no ``dense_window``).
    """
    return make_caches(model, dict(bits=bits, seed=seed, residual=residual), kwargs)


def convert_prompt_cache(cache: Sequence[Any], bits: tuple[int, int] | int = DEFAULT_BITS, seed: int = 0,
                         residual: str = "conditional", **kwargs: Any) -> list:
    """Encode a list of mlx-lm caches (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache, CacheList)
    into their rvqstore forms; rvqstore caches and recurrent state are passed through."""
    return convert_caches(cache, dict(bits=bits, seed=seed, residual=residual), kwargs)
