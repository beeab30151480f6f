"""Write `config_tiny_llama.yaml`: a tiny LLaMA trained on the Python standard library's source code.

    python examples/config_tiny_llama.py        # rewrites examples/config_tiny_llama.yaml
    python run_train.py --config-file examples/config_tiny_llama.yaml

The config is built from nanocore's attrs classes; each plugin-owned section (the model, the
dataset, the optimizer, each logger) is built from the config class its plugin registered, taken
from the registries exactly as a training run would find it. The YAML is then loaded back, checked,
and compared with what was written, so the committed file is always valid and complete.
It runs on one CPU process in a few minutes, with byte tokens and no file to download.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from nanocore.config import (
    CheckpointsArgs,
    Config,
    DataArgs,
    DatasetSpec,
    DatasetStageArgs,
    GeneralArgs,
    LoggerSpec,
    LoggingArgs,
    LRSchedulerArgs,
    ModelArgs,
    OptimizerArgs,
    OptimizerFactory,
    ParallelismArgs,
    TokenizerArgs,
    TokensArgs,
    dump_yaml,
)
from nanocore.config.load import load_config
from nanocore.config.schema import InitMethod
from nanocore.plugins import load_plugins

HERE = Path(__file__).resolve().parent
YAML_PATH = HERE / "config_tiny_llama.yaml"
YAML_3D_PATH = HERE / "config_tiny_llama_3d.yaml"
LOCAL_PLUGINS = ["local_plugins/stdlib_corpus.py"]  # relative to the YAML file

HEADER = """\
# A tiny LLaMA (~1M parameters) trained on the Python standard library's own source code, byte tokens.
# Written by examples/config_tiny_llama.py: edit that file and rerun it rather than editing this one.
#   python run_train.py --config-file examples/config_tiny_llama.yaml
#   python run_generate.py --ckpt-path checkpoints/tiny_llama --prompt "def " --max-new-tokens 200
"""


def build_config() -> Config:
    registries = load_plugins(yaml_plugins=LOCAL_PLUGINS, yaml_dir=HERE).registries
    LlamaConfig = registries.model.get("llama").config_class
    StdlibCorpusArgs = registries.dataset_format.get("python_stdlib").config_class
    AdamWArgs = registries.optimizer.get("adam_w").config_class
    ConsoleOptions = registries.logger.get("console").config_class
    TensorBoardOptions = registries.logger.get("tensorboard").config_class

    byte_vocab, eos = 257, 256  # the `byte` tokenizer: 256 byte values + end-of-sequence
    model = ModelArgs(
        model_config=LlamaConfig(
            bos_token_id=eos,
            eos_token_id=eos,
            hidden_size=128,
            intermediate_size=352,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_hidden_layers=4,
            max_position_embeddings=256,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            vocab_size=byte_vocab,
        ),
        model_type="llama",
        init_method=InitMethod(std=0.02),
        dtype="float32",
        make_vocab_size_divisible_by=64,  # 257 -> 320: matmul-friendly, and divisible by any tp up to 5
    )
    corpus = StdlibCorpusArgs(max_megabytes=4.0, validation_every=20)
    return Config(
        general=GeneralArgs(project="nanocore_examples", run="tiny_llama", seed=42),
        model=model,
        tokenizer=TokenizerArgs(tokenizer_name_or_path="byte"),
        tokens=TokensArgs(
            sequence_length=256,
            train_steps=600,
            micro_batch_size=16,
            batch_accumulation_per_replica=1,
            val_check_interval=100,
            limit_val_batches=4,
        ),
        parallelism=ParallelismArgs(dp=1, tp=1, pp=1, pp_engine="1f1b", tp_mode="ALL_REDUCE"),
        optimizer=OptimizerArgs(
            optimizer_factory=OptimizerFactory(name="adam_w", args=AdamWArgs(adam_beta1=0.9, adam_beta2=0.95)),
            learning_rate_scheduler=LRSchedulerArgs(
                learning_rate=3e-3, lr_warmup_steps=30, lr_decay_style="cosine", min_decay_lr=3e-4
            ),
            zero_stage=0,
            weight_decay=0.1,
            clip_grad=1.0,
            accumulate_grad_in_fp32=True,
        ),
        data_stages=[
            DatasetStageArgs(
                name="stdlib",
                start_training_step=1,
                data=DataArgs(
                    dataset=[DatasetSpec(format="python_stdlib", args=corpus)],
                    validation_dataset=[DatasetSpec(format="python_stdlib", args=corpus)],  # held-out files
                ),
            )
        ],
        checkpoints=CheckpointsArgs(
            checkpoints_path="checkpoints/tiny_llama", checkpoint_interval=200, save_final_state=True
        ),
        logging=LoggingArgs(
            log_dir="logs/tiny_llama",
            loggers=[
                LoggerSpec("console", ConsoleOptions(every=20)),
                LoggerSpec("jsonl"),
                LoggerSpec("tensorboard", TensorBoardOptions()),
            ],
            iteration_step_info_interval=1,
        ),
        plugins=list(LOCAL_PLUGINS),
    )


HEADER_3D = """\
# The tiny example on a 3D layout: dp2 x tp2 x pp2 = 8 processes, on CPU (gloo) or 8 GPUs (NCCL).
# Same model, data and global batch (16 sequences) as config_tiny_llama.yaml, so the losses match it.
# Written by examples/config_tiny_llama.py.
#   torchrun --nproc_per_node=8 run_train.py --config-file examples/config_tiny_llama_3d.yaml
"""


def build_3d_config() -> Config:
    """The same run split over dp2 x tp2 x pp2 (1F1B, sequence-parallel TP, ZeRO-1)."""
    config = build_config()
    return attrs.evolve(
        config,
        general=attrs.evolve(config.general, run="tiny_llama_3d"),
        parallelism=ParallelismArgs(dp=2, tp=2, pp=2, pp_engine="1f1b", tp_mode="REDUCE_SCATTER"),
        # global batch 2 (dp) x 4 (micro) x 2 (accumulation) = 16 sequences, as in the 1-process run
        tokens=attrs.evolve(
            config.tokens, micro_batch_size=4, batch_accumulation_per_replica=2, train_steps=100, val_check_interval=50
        ),
        optimizer=attrs.evolve(config.optimizer, zero_stage=1),
        checkpoints=attrs.evolve(
            config.checkpoints, checkpoints_path="checkpoints/tiny_llama_3d", checkpoint_interval=50
        ),
        logging=attrs.evolve(config.logging, log_dir="logs/tiny_llama_3d"),
    )


def write(path: Path, header: str, config: Config, world_size: int) -> None:
    text = header + dump_yaml(config)
    path.write_text(text)
    loaded = load_config(path, world_size=world_size)  # the same checks a training launch runs
    if header + dump_yaml(loaded.config) != text:
        raise SystemExit(f"{path} does not read back as the config that was written")
    print(f"wrote {path}")


def main() -> None:
    write(YAML_PATH, HEADER, build_config(), world_size=1)
    write(YAML_3D_PATH, HEADER_3D, build_3d_config(), world_size=8)


if __name__ == "__main__":
    main()
