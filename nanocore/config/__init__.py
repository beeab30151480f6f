"""Typed YAML config: schema, strict converter, cross-field checks."""

from nanocore.config.converter import dump_yaml, read_yaml, structure_config, unstructure_config
from nanocore.config.schema import (
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
)

__all__ = [
    "CheckpointsArgs",
    "Config",
    "DataArgs",
    "DatasetSpec",
    "DatasetStageArgs",
    "GeneralArgs",
    "LoggerSpec",
    "LoggingArgs",
    "LRSchedulerArgs",
    "ModelArgs",
    "OptimizerArgs",
    "OptimizerFactory",
    "ParallelismArgs",
    "TokenizerArgs",
    "TokensArgs",
    "dump_yaml",
    "read_yaml",
    "structure_config",
    "unstructure_config",
]
