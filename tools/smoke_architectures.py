"""Every hybrid / sliding-window architecture of mlx-lm 0.32 named in issue 10, on tiny random-weight models.

For each: rvqstore.make_prompt_cache follows the model's make_cache(); 4+4 logits vs mlx-lm's own caches
(relative L2 over a 40-token prompt in 12-token chunks, then 2 decode steps; the window is 16 tokens);
save -> resume gives exactly the in-memory logits. The architectures the test suite covers
(tests/tiny_models.py) are listed too. No download: configs are tiny versions of the real ones.

    python tools/smoke_architectures.py [--md tools/results/architectures-smoke.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_prompt_cache  # noqa: E402

import rvqstore  # noqa: E402
from rvqstore.generation import prefill  # noqa: E402
from tiny_models import _COMMON, CONFIGS, WINDOW, prompt_tokens, step_logits  # noqa: E402

EXTRA = {
    "gemma4_text": dict(_COMMON, model_type="gemma4_text", num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=32, global_head_dim=64, num_kv_shared_layers=2,
                        vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, sliding_window=WINDOW,
                        sliding_window_pattern=2, max_position_embeddings=512, use_double_wide_mlp=False,
                        layer_types=["sliding_attention", "full_attention"] * 2),
    "cohere2": dict(_COMMON, model_type="cohere2", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2, layer_norm_eps=1e-5),
    "olmo3": dict(_COMMON, model_type="olmo3", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, sliding_window=WINDOW, rope_theta=10000.0,
                  layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]),
    "ministral3": dict(_COMMON, model_type="ministral3", num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                       layer_types=["sliding_attention", "full_attention"],
                       rope_parameters={"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                        "original_max_position_embeddings": 512}),
    "lfm2": dict(_COMMON, model_type="lfm2", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64,
                 block_ff_dim=128, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 full_attn_idxs=[1, 3], layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "jamba": dict(_COMMON, model_type="jamba", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                  mamba_d_conv=4, mamba_d_state=8, mamba_expand=2, num_experts=2, num_experts_per_tok=1,
                  max_position_embeddings=512),
    "nemotron_h": dict(_COMMON, model_type="nemotron_h", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=512, attention_bias=False, mamba_num_heads=4, mamba_head_dim=16,
                       mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
                       layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, hybrid_override_pattern="M*M-",
                       num_hidden_layers=4),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(
        _COMMON, model_type="qwen3_5_text", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "type": "default"})),
    "kimi_linear": dict(_COMMON, model_type="kimi_linear", num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, head_dim=16, rope_theta=10000.0, model_max_length=512, num_experts=2,
                        moe_intermediate_size=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                        v_head_dim=16, q_lora_rank=None, first_k_dense_replace=2,
                        linear_attn_config={"kda_layers": [1], "num_heads": 4, "head_dim": 16,
                                            "short_conv_kernel_size": 4}),
    "deepseek_v2": dict(_COMMON, model_type="deepseek_v2", num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=None, moe_intermediate_size=64,
                        max_position_embeddings=512, rope_scaling={"type": "yarn", "factor": 1.0,
                                                                   "original_max_position_embeddings": 512}),
}


def check(cfg: dict) -> dict:
    import importlib

    mod = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)
    toks, more = prompt_tokens(40), [9, 10, 11, 12]
    ref = step_logits(model, mlx_lm_prompt_cache(model), toks + more)
    got = step_logits(model, rvqstore.make_prompt_cache(model, bits=(4, 4)), toks + more)
    cache = rvqstore.make_prompt_cache(model, bits=(2, 2))
    prefill(model, toks, cache)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s.rvq"
        rvqstore.save_prompt_cache(path, cache, tokens=toks, model=model)
        with rvqstore.open(path) as f:
            kinds = [layer.kind for layer in f.layers]
        mem = prefill(model, more, cache)
        r = rvqstore.resume(path, toks + more, model)
        res = prefill(model, r.remaining, r.cache)
    return {"kinds": kinds, "rel": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
            "exact": bool(mx.array_equal(mem, res).item()) and r.reused == 40}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", default="tools/results/architectures-smoke.md")
    args = ap.parse_args()
    lines = ["# Cache kinds on tiny random-weight models of each architecture",
             "", "`python tools/smoke_architectures.py` (configs inside; window 16, prompt 40 tokens).", "",
             "| architecture | layer kinds in the snapshot | 4+4 logits rel. L2 vs mlx-lm caches | save -> resume exact |",
             "|---|---|---|---|"]
    for name, cfg in {**CONFIGS, **EXTRA}.items():
        try:
            r = check(cfg)
            kinds = ", ".join(f"{k} x{r['kinds'].count(k)}" for k in dict.fromkeys(r["kinds"]))
            line = f"| {name} | {kinds} | {r['rel']:.4f} | {'yes' if r['exact'] else 'NO'} |"
        except Exception as e:  # noqa: BLE001 - the table says what failed
            traceback.print_exc()
            line = f"| {name} | error: {type(e).__name__}: {str(e)[:120]} | – | – |"
        print(line, flush=True)
        lines.append(line)
    Path(args.md).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
