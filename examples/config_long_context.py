"""Write `config_long_context.yaml`: the tiny LLaMA example on sequences 8x as long (2048 bytes),
each split over 4 context-parallel processes, with document masking.

    python examples/config_long_context.py          # rewrites examples/config_long_context.yaml
    torchrun --nproc_per_node=4 run_train.py --config-file examples/config_long_context.yaml
    python run_generate.py --ckpt-path checkpoints/long_context --prompt "def " --max-new-tokens 200

Everything but the sequence geometry is the tiny example's (examples/config_tiny_llama.py): the same
model (with rotary positions up to 2048), corpus, optimizer and tokens per step (2 sequences of 2048
instead of 16 of 256). Each sequence is cut into 8 chunks; process r holds chunks r and 7-r and
computes attention as a ring with the other three (docs/context_parallel.md). Every source file of
the corpus is one document: with `document_masking` a file never attends to the one packed before
it, and rotary positions restart at each file.
"""

from __future__ import annotations

import attrs
from config_tiny_llama import HERE, build_config, write  # this folder is on sys.path when run as a script

from nanocore.config import Config

YAML_PATH = HERE / "config_long_context.yaml"

HEADER = """\
# The tiny LLaMA example on 2048-byte sequences (8x), each split over 4 context-parallel processes
# (ring attention), packed files kept apart by document masking. Runs on CPU (gloo) or 4 GPUs.
# Written by examples/config_long_context.py: edit that file and rerun it rather than editing this one.
#   torchrun --nproc_per_node=4 run_train.py --config-file examples/config_long_context.yaml
#   python run_generate.py --ckpt-path checkpoints/long_context --prompt "def " --max-new-tokens 200
"""

SEQUENCE = 2048


def build_long_context_config() -> Config:
    tiny = build_config()
    model_config = attrs.evolve(tiny.model.model_config, max_position_embeddings=SEQUENCE)
    return attrs.evolve(
        tiny,
        general=attrs.evolve(tiny.general, run="long_context"),
        model=attrs.evolve(tiny.model, model_config=model_config),
        parallelism=attrs.evolve(tiny.parallelism, context_parallel_size=4),
        # 2 x 2048 = 4096 tokens per step, as the tiny example's 16 x 256
        tokens=attrs.evolve(
            tiny.tokens,
            sequence_length=SEQUENCE,
            micro_batch_size=2,
            train_steps=300,
            val_check_interval=100,
            limit_val_batches=4,
            document_masking=True,
        ),
        checkpoints=attrs.evolve(
            tiny.checkpoints, checkpoints_path="checkpoints/long_context", checkpoint_interval=100
        ),
        logging=attrs.evolve(tiny.logging, log_dir="logs/long_context"),
    )


def main() -> None:
    write(YAML_PATH, HEADER, build_long_context_config(), world_size=4)


if __name__ == "__main__":
    main()
