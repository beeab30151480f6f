"""nanocore built-in plugin: metric loggers (console, jsonl, tensorboard, wandb)."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore_plugins.loggers.console import ConsoleLogger, ConsoleOptions
from nanocore_plugins.loggers.jsonl import JsonlLogger
from nanocore_plugins.loggers.tensorboard_logger import TensorBoardLogger, TensorBoardOptions
from nanocore_plugins.loggers.wandb_logger import WandbLogger, WandbOptions


@hookimpl
def register_loggers(registry):
    registry.register(
        "console",
        ConsoleLogger,
        config_class=ConsoleOptions,
        description="progress bar with loss, lr, tokens/s and ETA (plain lines when not on a terminal)",
    )
    registry.register("jsonl", JsonlLogger, description="one JSON object per row in log_dir/metrics.jsonl")
    registry.register(
        "tensorboard",
        TensorBoardLogger,
        config_class=TensorBoardOptions,
        description="TensorBoard scalars train/<name>",
    )
    registry.register("wandb", WandbLogger, config_class=WandbOptions, description="Weights & Biases run")
