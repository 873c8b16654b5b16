"""Loading llama-architecture GGUF files as mlx-lm ``llama.Model``s.

The model is mlx-lm's own ``llama.Model`` so that caches and generation go through the same code as
any mlx-lm model; only the weight names, the quantization layout and the tokenizer have to be
translated from GGUF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import UnsupportedModelError
from .tokenizer import GGUFTokenizer, _scalar

# GGUF tensor name -> mlx-lm llama name (blk.N. prefix handled separately).
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _meta_float(v: Any) -> float:
    # GGUF floats are float32; round-trip through its repr so 1e-5 reads as 1e-05, not 9.99e-06.
    return float(str(np.float32(_scalar(v))))


def _gguf_to_mlx_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3:]
        if base not in _GGUF_NAMES:
            raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
        return ".".join([f"model.layers.{layer}", _GGUF_NAMES[base], *suffix])
    if parts[0] not in _GGUF_NAMES:
        raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
    return ".".join([_GGUF_NAMES[parts[0]], *parts[1:]])


def _llama_args(meta: dict[str, Any], weights: dict[str, mx.array]) -> Any:
    from mlx_lm.models.llama import ModelArgs

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"llama.{key}", default)
        return _scalar(v)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim})")
    if "rope_freqs.weight" in weights:
        raise UnsupportedModelError("GGUF rope_freqs (llama3-style rope scaling) is not supported")
    scaling = get("rope.scaling.type")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"type": "linear", "factor": _meta_float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(get("block_count")),
        intermediate_size=int(get("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        rms_norm_eps=_meta_float(get("attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 2048)),
        rope_theta=_meta_float(get("rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes Q/K rows so RoPE rotates adjacent pairs (the
        # "traditional" layout); non-traditional rope on these weights gives garbage.
        rope_traditional=True,
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in weights,
    )


# ggml tensor types mx.load reads into arrays this loader handles: F32, F16, Q4_0, Q4_1, Q8_0, BF16.
_HANDLED_TENSOR_TYPES = {0, 1, 2, 3, 8, 30}


def check_gguf_supported(path: Path) -> None:
    """Raise UnsupportedModelError naming every architecture / vocabulary / tensor type this loader does
    not handle, read from the GGUF header alone (no tensor is loaded)."""
    from .gguf_header import read_gguf_header
    from .tokenizer import _PRE_TOKENIZERS

    h = read_gguf_header(path)
    meta = h.metadata
    problems = []
    arch = meta.get("general.architecture")
    if arch != "llama":
        problems.append(f"architecture {arch!r} (only 'llama'; use an mlx-lm model folder for other models)")
    vocab = meta.get("tokenizer.ggml.model")
    if vocab != "gpt2":
        problems.append(f"vocabulary type {vocab!r} (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if vocab == "gpt2" and pre not in _PRE_TOKENIZERS:
        problems.append(f"pre-tokenizer {pre!r}")
    bad: dict[str, int] = {}
    for t in h.tensors:
        if t.ggml_type not in _HANDLED_TENSOR_TYPES:
            bad[t.type_name] = bad.get(t.type_name, 0) + 1
    if bad:
        problems.append("tensor types " + ", ".join(f"{k} ({n} tensors)" for k, n in sorted(bad.items()))
                        + " (handled: F32, F16, BF16, Q4_0, Q4_1, Q8_0)")
    if problems:
        raise UnsupportedModelError(f"{path}: this GGUF is not supported: " + "; ".join(problems))


def load_gguf(path: Path) -> tuple[nn.Module, GGUFTokenizer]:
    from mlx_lm.models.llama import Model

    check_gguf_supported(path)
    raw, meta = mx.load(str(path), return_metadata=True)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    args = _llama_args(meta, raw)
    weights = {_gguf_to_mlx_name(k): v for k, v in raw.items()}
    model = Model(args)

    # Quantized GGUF types come back as mlx affine triplets (weight uint32 + scales + biases);
    # read bits and group size per tensor from the shapes, since files mix types (here: 8-bit
    # embedding, 4-bit elsewhere, group 32).
    def quant_params(prefix: str, module: nn.Module) -> bool | dict[str, int]:
        scales = weights.get(f"{prefix}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        in_dims = module.weight.shape[-1]
        packed = weights[f"{prefix}.weight"].shape[-1]
        return {"group_size": in_dims // scales.shape[-1], "bits": packed * 32 // in_dims}

    nn.quantize(model, class_predicate=quant_params)
    model.load_weights(list(weights.items()), strict=True)
    return model, GGUFTokenizer.from_gguf_metadata(meta)
