"""Write `config_tiny_deepseek_v3.yaml`: a tiny DeepSeek-V3 on the tiny example's corpus.

    python examples/config_tiny_deepseek_v3.py          # rewrites examples/config_tiny_deepseek_v3.yaml
    python run_train.py --config-file examples/config_tiny_deepseek_v3.yaml
    python run_generate.py --ckpt-path checkpoints/tiny_deepseek_v3 --prompt "def " --max-new-tokens 200

Everything but the model is the tiny LLaMA example's (examples/config_tiny_llama.py): the same
corpus, batch, steps and optimizer. The model keeps the dense example's width, depth and heads and
takes DeepSeek-V3's parts: multi-head latent attention (a 64-wide query bottleneck, a 64-wide shared
key/value latent, per head 32 dimensions without and 16 with rotary positions, values 32 wide), the
first layer dense, the other three with one shared expert and 8 routed experts of width 88 in 4
groups, each token picking 2 experts from its best 2 groups (sigmoid scores, balanced by a per-expert
bias rather than an auxiliary loss, moved 10x faster than DeepSeek-V3's for a run this short).
"""

from __future__ import annotations

import attrs
from config_tiny_llama import HERE, build_config, write  # this folder is on sys.path when run as a script

from nanocore.config import Config
from nanocore.plugins import load_plugins

YAML_PATH = HERE / "config_tiny_deepseek_v3.yaml"

HEADER = """\
# A tiny DeepSeek-V3 (multi-head latent attention; 1 dense + 3 MoE layers, 8 routed experts in 4 groups,
# top-2, 1 shared expert) trained on the Python standard library's own source code, byte tokens.
# Written by examples/config_tiny_deepseek_v3.py: edit that file and rerun it rather than editing this one.
#   python run_train.py --config-file examples/config_tiny_deepseek_v3.yaml
#   python run_generate.py --ckpt-path checkpoints/tiny_deepseek_v3 --prompt "def " --max-new-tokens 200
"""


def build_deepseek_v3_config() -> Config:
    dense = build_config()
    DeepseekV3Config = load_plugins().registries.model.get("deepseek_v3").config_class
    c = dense.model.model_config
    keep = ("bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "intermediate_size", "num_attention_heads",
            "num_hidden_layers", "max_position_embeddings", "rms_norm_eps", "rope_theta", "vocab_size",
            "tie_word_embeddings")  # fmt: skip
    model_config = DeepseekV3Config(
        **{key: getattr(c, key) for key in keep},
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        moe_intermediate_size=88,  # each expert: a quarter of the dense MLP; 2 routed + 1 shared per token
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.0,
        # DeepSeek-V3 moved its bias by 0.001 a step over 14.8T tokens; in a 600-step run routing collapses
        # onto a few experts before that catches up (measured: busiest expert 3.96x the mean by step 21)
        router_bias_update_rate=0.01,
    )
    model = attrs.evolve(dense.model, model_config=model_config, model_type="deepseek_v3")
    return attrs.evolve(
        dense,
        general=attrs.evolve(dense.general, run="tiny_deepseek_v3"),
        model=model,
        checkpoints=attrs.evolve(dense.checkpoints, checkpoints_path="checkpoints/tiny_deepseek_v3"),
        logging=attrs.evolve(dense.logging, log_dir="logs/tiny_deepseek_v3"),
    )


def main() -> None:
    write(YAML_PATH, HEADER, build_deepseek_v3_config(), world_size=1)


if __name__ == "__main__":
    main()
