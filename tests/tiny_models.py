"""Tiny random-weight mlx-lm models of several architectures (no download), for the cache-kind tests.

Each config keeps every dim small (hidden 64, 2-6 layers, head dims the codec takes) and a sliding
window of 16 tokens where the architecture has one, so prompts of 8 and 40 tokens fall on both sides
of it.
"""

from __future__ import annotations

import importlib
from typing import Any

WINDOW = 16
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, rms_norm_eps=1e-5, tie_word_embeddings=True)

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, model_type="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16),
    "qwen3": dict(_COMMON, model_type="qwen3", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=512, rope_theta=10000.0),
    "gemma3_text": dict(_COMMON, model_type="gemma3_text", num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=32, sliding_window=WINDOW, sliding_window_pattern=3,
                        query_pre_attn_scalar=32, max_position_embeddings=512),
    "gpt_oss": dict(_COMMON, model_type="gpt_oss", num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, num_local_experts=2,
                    num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"],
                    rope_theta=10000.0, swiglu_limit=7.0),
    "qwen3_next": dict(_COMMON, model_type="qwen3_next", num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       full_attention_interval=2, num_experts=2, num_experts_per_tok=1, decoder_sparse_step=1,
                       shared_expert_intermediate_size=64, moe_intermediate_size=64, mlp_only_layers=[],
                       rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=512),
    "falcon_h1": dict(_COMMON, model_type="falcon_h1", num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                      mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16, mamba_d_conv=4, rope_theta=10000.0,
                      max_position_embeddings=512),
    "deepseek_v3": dict(_COMMON, model_type="deepseek_v3", num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=None, first_k_dense_replace=2,
                        moe_intermediate_size=64, max_position_embeddings=512, rope_theta=10000.0),
}


def build(arch: str, seed: int = 0):
    """A random-weight float32 model of ``arch``: (model, config dict)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    cfg = dict(CONFIGS[arch])
    mod = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    args = mod.ModelArgs.from_dict(cfg)
    mx.random.seed(seed)
    model = mod.Model(args)
    # mlx-lm's default init is fine for linears; also give norms random scales so that no layer is trivial
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    assert tree_flatten(model.parameters())
    return model, cfg


def gpu_llama(seed: int = 0):
    """A random-weight float16 llama whose attention the GPU kernels take (GQA 4, head dim 128, 4 layers,
    vocab 512): the model of the GPU generation tests."""
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=512, num_hidden_layers=4, intermediate_size=1024,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5,
                           vocab_size=512, tie_word_embeddings=True)
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    return model


def write_model_folder(arch: str, folder, seed: int = 0):
    """An mlx-lm model folder (config.json, safetensors, tokenizer) of a random-weight ``arch`` model,
    written with mlx-lm's own save utilities; its tokenizer maps each lowercase letter, digit and space
    to one id (128 ids in all, the model's vocabulary). Returns the model."""
    from pathlib import Path

    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    model, cfg = build(arch, seed)
    save_model(folder, model)
    save_config(dict(cfg), folder / "config.json")
    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: i + 3 for i, ch in enumerate(chars)}}
    vocab.update({f"<extra_{i}>": i for i in range(len(vocab), cfg["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))
    return model


def prompt_tokens(n: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids inside every tiny vocabulary."""
    return [(7 * i + 3) % 120 + 3 for i in range(n)]


def step_logits(model, cache, tokens):
    """Logits of a chunk of ``tokens`` and then of single-token steps (the decode path), as float32 numpy."""
    import mlx.core as mx
    import numpy as np

    from rvqstore.generation import prefill

    out = [prefill(model, tokens[:-2], cache, chunk=12)]
    for t in tokens[-2:]:
        out.append(model(mx.array([[t]]), cache=cache)[:, -1, :])
    return np.concatenate([np.array(o.astype(mx.float32)) for o in out])
