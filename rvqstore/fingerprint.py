"""The identity of a (model, tokenizer) pair, stored in a snapshot's header and checked on reload."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .tokenizer import vocab_hash

__all__ = ["model_fingerprint", "WEIGHTS_HASH_VERSION"]

#: the prefix of ``weights_sha256``'s input: names the definition of the hash (kept hashes are keyed by it)
WEIGHTS_HASH_VERSION = b"rvqstore-weights-v2"


def _float32_weights(model: nn.Module) -> Iterable[tuple[str, mx.array]]:
    """Every weight as float32 values, quantized layers dequantized, in name order.

    The same file loaded dense or quantized (CPU vs GPU) yields the same values, so the same hash.
    """
    quantized = {}
    for name, m in model.named_modules():
        if hasattr(m, "scales") and hasattr(m, "group_size") and hasattr(m, "bits"):
            quantized[name] = m
    out = []
    for name, a in tree_flatten(model.parameters()):
        prefix, _, leaf = name.rpartition(".")
        m = quantized.get(prefix)
        if m is not None:
            if leaf != "weight":
                continue  # scales/biases are folded into the dequantized weight
            a = mx.dequantize(m.weight, m.scales, getattr(m, "biases", None), group_size=m.group_size, bits=m.bits)
        out.append((name, a.astype(mx.float32)))
    return sorted(out, key=lambda kv: kv[0])


def _weights_sha256(model: nn.Module) -> str:
    # Every weight in name order: name, shape, then its float32 bytes (quantized layers
    # dequantized first). Cheap enough to hash in full, no sampling: ~0.3 s for SmolLM2-135M.
    h = hashlib.sha256(WEIGHTS_HASH_VERSION)
    for name, a in _float32_weights(model):
        h.update(f"{name}|{tuple(a.shape)}\n".encode())
        h.update(np.ascontiguousarray(np.asarray(a)).data)
    return h.hexdigest()


def model_fingerprint(model: nn.Module, tokenizer: Any, source: str | Path | None = None, *,
                      weights_sha256: str | None = None) -> dict[str, str | int]:
    """Identity of a (model, tokenizer) pair, to store in a cache header and check on reload.

    Keys: ``model_type``, ``num_layers``, ``num_kv_heads``, ``head_dim``, ``hidden_size``,
    ``vocab_size`` (ints/str from the model's args), ``weights_sha256`` (sha256 over every weight's
    name, shape and float32 values in name order, quantized layers dequantized first: the same file
    loaded dense on a CPU or quantized on a GPU hashes the same), ``vocab_sha256``
    (:func:`vocab_hash`; omitted when ``tokenizer`` is None) and, when given, ``source`` (a free-form
    label such as the path; leave it out of equality checks if files may move). Deterministic across
    processes; plain str/int values only, so it packs into msgpack as is. ``weights_sha256``: that hash,
    known already for these weights (:mod:`rvqstore.weights_cache`), instead of computing it.
    """
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)  # multimodal wrappers (qwen3_5, gemma3) keep them there
    text = text if isinstance(text, dict) else {}

    def arg(name: str, default: Any = None) -> Any:
        v = getattr(args, name, None)
        return text.get(name, default) if v is None else v

    heads = int(arg("num_attention_heads", 1))
    hidden = int(arg("hidden_size", 0))
    fp: dict[str, str | int] = {
        "model_type": str(arg("model_type") or getattr(model, "model_type", "unknown")),
        "num_layers": len(model.layers),
        "num_kv_heads": int(arg("num_key_value_heads") or heads),
        "head_dim": int(arg("head_dim") or hidden // heads),
        "hidden_size": hidden,
        "vocab_size": int(arg("vocab_size", 0)),
        "weights_sha256": weights_sha256 or _weights_sha256(model),
    }
    if tokenizer is not None:
        fp["vocab_sha256"] = vocab_hash(tokenizer)
    if source is not None:
        fp["source"] = str(source)
    return fp
