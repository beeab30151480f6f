"""Write `config_tiny_qwen3.yaml`: a tiny Qwen3 on the tiny example's corpus.

    python examples/config_tiny_qwen3.py          # rewrites examples/config_tiny_qwen3.yaml
    python run_train.py --config-file examples/config_tiny_qwen3.yaml
    python run_generate.py --ckpt-path checkpoints/tiny_qwen3 --prompt "def " --max-new-tokens 200

Everything but the model is the tiny LLaMA example's (examples/config_tiny_llama.py): the same
corpus, batch, steps and optimizer, so the runs' losses compare directly. The model is the dense
example's with Qwen3's differences: an RMSNorm on every query and key head before rotary (qk-norm),
and a head size of its own (head_dim 48 with 4 heads in a width of 128, rather than 32), with
grouped-query attention (2 key/value heads).
"""

from __future__ import annotations

import attrs
from config_tiny_llama import HERE, build_config, write  # this folder is on sys.path when run as a script

from nanocore.config import Config
from nanocore.plugins import load_plugins

YAML_PATH = HERE / "config_tiny_qwen3.yaml"

HEADER = """\
# A tiny Qwen3 (qk-norm, head_dim 48, grouped-query attention; ~1.0M parameters) trained on the Python
# standard library's own source code, byte tokens: the tiny LLaMA example with Qwen3's attention.
# Written by examples/config_tiny_qwen3.py: edit that file and rerun it rather than editing this one.
#   python run_train.py --config-file examples/config_tiny_qwen3.yaml
#   python run_generate.py --ckpt-path checkpoints/tiny_qwen3 --prompt "def " --max-new-tokens 200
"""


def build_qwen3_config() -> Config:
    dense = build_config()
    Qwen3Config = load_plugins().registries.model.get("qwen3").config_class
    fields = attrs.asdict(dense.model.model_config, recurse=False)
    for key in ("pretraining_tp", "rope_interleaved"):  # LLaMA's nanotron-only fields
        fields.pop(key)
    fields.update(head_dim=48, num_key_value_heads=2)
    model = attrs.evolve(dense.model, model_config=Qwen3Config(**fields), model_type="qwen3")
    return attrs.evolve(
        dense,
        general=attrs.evolve(dense.general, run="tiny_qwen3"),
        model=model,
        checkpoints=attrs.evolve(dense.checkpoints, checkpoints_path="checkpoints/tiny_qwen3"),
        logging=attrs.evolve(dense.logging, log_dir="logs/tiny_qwen3"),
    )


def main() -> None:
    write(YAML_PATH, HEADER, build_qwen3_config(), world_size=1)


if __name__ == "__main__":
    main()
