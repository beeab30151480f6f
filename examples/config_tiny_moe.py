"""Write `config_tiny_moe.yaml`: a tiny Mixtral (mixture of experts) on the tiny example's corpus.

    python examples/config_tiny_moe.py          # rewrites examples/config_tiny_moe.yaml
    python run_train.py --config-file examples/config_tiny_moe.yaml
    python run_generate.py --ckpt-path checkpoints/tiny_moe --prompt "def " --max-new-tokens 200

Everything but the model is the tiny LLaMA example's (examples/config_tiny_llama.py): the same
corpus (the Python standard library's source, byte tokens, held-out files for validation), batch,
steps and optimizer, so the two runs' losses compare directly. The model keeps the dense example's
attention and its active parameters per token: each of its 4 decoder layers routes every token to 2
of 8 SwiGLU experts that are each half as wide as the dense example's MLP (176 vs 352), so a token
costs the same matmul FLOPs while the layer holds 4x the MLP parameters.
"""

from __future__ import annotations

import attrs
from config_tiny_llama import HERE, build_config, write  # this folder is on sys.path when run as a script

from nanocore.config import Config
from nanocore.plugins import load_plugins

YAML_PATH = HERE / "config_tiny_moe.yaml"

HEADER = """\
# A tiny Mixtral (8 experts, top-2; ~2.4M parameters, ~1M active per token) trained on the Python
# standard library's own source code, byte tokens: the tiny LLaMA example with a mixture of experts.
# Written by examples/config_tiny_moe.py: edit that file and rerun it rather than editing this one.
#   python run_train.py --config-file examples/config_tiny_moe.yaml
#   python run_generate.py --ckpt-path checkpoints/tiny_moe --prompt "def " --max-new-tokens 200
"""


def build_moe_config() -> Config:
    dense = build_config()
    MixtralConfig = load_plugins().registries.model.get("mixtral").config_class
    fields = attrs.asdict(dense.model.model_config, recurse=False)
    fields.update(
        intermediate_size=176,  # each expert: half the dense MLP, and 2 experts per token
        num_local_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
    )
    model = attrs.evolve(dense.model, model_config=MixtralConfig(**fields), model_type="mixtral")
    return attrs.evolve(
        dense,
        general=attrs.evolve(dense.general, run="tiny_moe"),
        model=model,
        checkpoints=attrs.evolve(dense.checkpoints, checkpoints_path="checkpoints/tiny_moe"),
        logging=attrs.evolve(dense.logging, log_dir="logs/tiny_moe"),
    )


def main() -> None:
    write(YAML_PATH, HEADER, build_moe_config(), world_size=1)


if __name__ == "__main__":
    main()
