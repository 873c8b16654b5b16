"""Does a snapshot belong to this model? The check fails closed.

Three parts, all run on every load/resume given a model (and on save, against the caches):

- **Fingerprint identity.** A stored fingerprint must hold every key of :data:`IDENTITY_KEYS`
  (``model: {}``, only unknown keys, a renamed ``weights_sha256`` are refused) and each must equal the
  model's; ``vocab_sha256`` is compared when both sides have one; other keys (``source``, a newer
  writer's extras) are labels, not identity.
- **Geometry, with or without a fingerprint.** Every attention layer map's ``n_kv_heads``, ``head_dim``
  and ``value_head_dim`` must equal what the model's own caches receive. They are read from the model
  by building (not evaluating) one forward pass over ``model.make_cache()``: MLX is lazy, so the
  shapes are known without computing anything, for any architecture (GQA; MLA, whose cache holds one
  latent head whatever ``num_key_value_heads`` says; per-layer windows).
- **A memo that sees in-place edits.** Hashing every weight for ``weights_sha256`` costs ~1 s for
  SmolLM2-135M on this 2-core CPU (21.1 s for a 1.5B float16 model); the memo is reused only while a
  digest of the raw parameters (names, shapes, dtypes, bits: :mod:`rvqstore.parameter_digest`, on the
  host on a CPU, on the device on a GPU) is unchanged, so ``w[0, 0] += 1`` is noticed. A process
  without a memo takes the hash from :mod:`rvqstore.weights_cache` when these raw parameters were
  hashed on this machine before (tools/results/model-check-cpu.txt).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from . import weights_cache
from .errors import ModelMismatchError
from .fingerprint import model_fingerprint
from .parameter_digest import parameters_digest

#: Keys a stored fingerprint must have for the snapshot to be accepted with ``model=``.
IDENTITY_KEYS = ("model_type", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size",
                 "weights_sha256")
#: Compared when the file and the caller both have it (a snapshot saved without a tokenizer has none).
OPTIONAL_KEYS = ("vocab_sha256",)
_ATTENTION_KINDS = ("rvq", "dense", "rvq-rotating")

# id(model) -> (weakref to the model, digest of its raw parameters, weakref to the tokenizer,
# fingerprint). Keyed by id: mlx modules are dicts, hence not hashable.
_FP_MEMO: dict[int, tuple] = {}


def fingerprint(model: Any, tokenizer: Any) -> dict:
    """:func:`rvqstore.fingerprint.model_fingerprint` of ``model`` (with its ``rvqstore_source`` label),
    memoized while the parameters' raw bytes and the tokenizer object stay the same; a process that has
    no memo yet takes ``weights_sha256`` from :mod:`rvqstore.weights_cache` where these raw parameters
    were hashed before."""
    digest = parameters_digest(model)
    hit = _FP_MEMO.get(id(model))
    if hit is not None:
        model_ref, memo_digest, tok_ref, fp = hit
        if model_ref() is model and memo_digest == digest and (tok_ref() if tok_ref else None) is tokenizer:
            return dict(fp)
    known = weights_cache.lookup(digest)
    fp = model_fingerprint(model, tokenizer, source=getattr(model, "rvqstore_source", None), weights_sha256=known)
    if known is None:
        weights_cache.keep(digest, fp["weights_sha256"])
    try:
        key = id(model)
        model_ref = weakref.ref(model, lambda _, key=key: _FP_MEMO.pop(key, None))
        tok_ref = None if tokenizer is None else weakref.ref(tokenizer)
    except TypeError:  # something not weak-referenceable: no memo
        return fp
    _FP_MEMO[key] = (model_ref, digest, tok_ref, dict(fp))
    return fp


def check_fingerprint(file_fp: Any, model: Any, tokenizer: Any = None, *, path: str = "") -> None:
    """Raise ModelMismatchError unless ``file_fp`` (a stored fingerprint, or None) fits ``model``."""
    if file_fp is None:
        return
    if not isinstance(file_fp, dict):
        raise ModelMismatchError(f"{path}: the stored model fingerprint is not a map ({type(file_fp).__name__})")
    missing = [k for k in IDENTITY_KEYS if k not in file_fp]
    if missing:
        raise ModelMismatchError(f"{path}: the stored model fingerprint lacks {', '.join(missing)}, so it cannot "
                                 f"show the snapshot was made with this model")
    mine = fingerprint(model, tokenizer)
    diff = [k for k in IDENTITY_KEYS + OPTIONAL_KEYS if k in file_fp and k in mine and file_fp[k] != mine[k]]
    if diff:
        detail = ", ".join(f"{k}: file {file_fp[k]!r} vs model {mine[k]!r}" for k in diff[:4])
        made_with = file_fp.get("source")
        hint = (f"; it was made with {made_with!r}: load that model (CLI: --model {made_with})"
                if isinstance(made_with, str) and made_with else "")
        raise ModelMismatchError(f"{path}: snapshot was made with a different model ({detail}){hint}")


# ---- geometry ------------------------------------------------------------------------------------
def _cache_geometry(c: Any) -> Any:
    """``("kv", n_kv_heads, key_dim, value_dim)`` of a probed mlx-lm cache, ``("list", children)`` for
    a CacheList, None for state without that geometry (recurrent caches)."""
    from mlx_lm.models.cache import CacheList

    if isinstance(c, CacheList):
        return ("list", tuple(_cache_geometry(x) for x in c.caches))
    k, v = getattr(c, "keys", None), getattr(c, "values", None)
    if isinstance(k, mx.array) and isinstance(v, mx.array) and k.ndim == 4 and v.ndim == 4:
        return ("kv", int(k.shape[1]), int(k.shape[3]), int(v.shape[3]))
    return None


def _args_geometry(model: Any) -> list | None:
    """Fallback from the model's args when a probe forward cannot run: one geometry for every layer."""
    args = getattr(model, "args", None)
    try:
        heads = int(args.num_attention_heads)
        kv = int(getattr(args, "num_key_value_heads", None) or heads)
        d = int(getattr(args, "head_dim", None) or args.hidden_size // heads)
        return [("kv", kv, d, d)] * len(model.layers)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


_GEO_MEMO: dict[int, tuple] = {}  # id(model) -> (weakref, parameter shapes, geometry)


def model_geometry(model: Any) -> list | None:
    """Per top-level layer, what the model's caches receive (see :func:`_cache_geometry`), or None if
    neither a probe forward nor the model's args tell."""
    shapes = tuple((n, tuple(a.shape)) for n, a in tree_flatten(model.parameters()))
    hit = _GEO_MEMO.get(id(model))
    if hit is not None and hit[0]() is model and hit[1] == shapes:
        return hit[2]
    try:
        from mlx_lm.models.cache import KVCache

        caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
        model(mx.array([[0]], dtype=mx.int32), cache=caches)  # graph only: nothing is evaluated
        geo = [_cache_geometry(c) for c in caches]
    except Exception:  # a model that cannot take a bare one-token call: its args say the same for plain models
        geo = _args_geometry(model)
    try:
        key = id(model)
        _GEO_MEMO[key] = (weakref.ref(model, lambda _, key=key: _GEO_MEMO.pop(key, None)), shapes, geo)
    except TypeError:
        pass
    return geo


def _get(layer: Any, name: str) -> Any:
    return layer.get(name) if isinstance(layer, dict) else getattr(layer, name, None)


def _layer_geometry(layer: Any) -> Any:
    """The same form as :func:`_cache_geometry`, from a layer map (LayerInfo or dict)."""
    kind = _get(layer, "kind")
    if kind == "list":
        return ("list", tuple(_layer_geometry(c) for c in (_get(layer, "children") or ())))
    if kind not in _ATTENTION_KINDS:
        return None
    d = _get(layer, "head_dim")
    return ("kv", _get(layer, "n_kv_heads"), d, _get(layer, "value_head_dim") or d)


def _compare(got: Any, want: Any, where: str) -> str | None:
    if want is None or got is None:  # recurrent state on either side: the kind check covers it
        return None
    if got[0] != want[0]:
        return f"{where}: {got[0]} layer in the file, {want[0]} in the model"
    if got[0] == "kv":
        if got != want:
            return f"{where}: (n_kv_heads, head_dim, value_head_dim) = {got[1:]} in the file, {want[1:]} in the model"
        return None
    if len(got[1]) != len(want[1]):
        return f"{where}: a list of {len(got[1])} caches in the file, {len(want[1])} in the model"
    for j, (g, w) in enumerate(zip(got[1], want[1])):
        why = _compare(g, w, f"{where}, child {j}")
        if why:
            return why
    return None


def check_geometry(layers: Sequence[Any], model: Any, *, path: str = "", has_fingerprint: bool = False) -> None:
    """Raise ModelMismatchError unless every attention layer's heads and head dims are the model's.

    ``layers``: LayerInfo objects or layer maps (dicts). A model whose geometry cannot be read is
    accepted only when a fingerprint vouches for the file.
    """
    want = model_geometry(model)
    if want is None:
        if has_fingerprint:
            return
        raise ModelMismatchError(f"{path}: the snapshot has no model fingerprint and this model's attention "
                                 f"geometry cannot be read, so nothing shows the snapshot fits it")
    if len(layers) != len(want):
        raise ModelMismatchError(f"{path}: {len(layers)} layers, but the model has {len(want)}")
    for i, (layer, w) in enumerate(zip(layers, want)):
        why = _compare(_layer_geometry(layer), w, f"layer {i}")
        if why:
            raise ModelMismatchError(f"{path}: {why}")
