"""The YAML config as attrs classes. Section and field names follow nanotron.

Sections owned by a plugin (a model's `model_config`, an optimizer's arguments, a dataset format's
arguments, a logger's options) are typed `Any` here and structured through the registry at load time,
so a third-party plugin brings its own config class.
"""

from __future__ import annotations

from typing import Any

import attrs


def doc(text: str, **kw: Any) -> Any:
    """An attrs field with its docstring kept in `metadata["doc"]`: every config field says what it is."""
    return attrs.field(metadata={"doc": text}, **kw)


@attrs.define
class GeneralArgs:
    """Run identity and global seed."""

    project: str = doc("Project name (used by loggers such as wandb).", default="nanocore")
    run: str = doc("Run name; `%date` is replaced by the launch time.", default="run")
    seed: int = doc("Seed for weights, data order and every rank's RNG.", default=42)
    hardware: str | None = doc(
        "The hardware description MFU (and the layout check) is measured against: a shipped name "
        "(a100-80gb, h100-sxm, h200) or a YAML file `nanocore calibrate` wrote. null: on NVIDIA GPUs "
        "the datasheet table by device name, on CPU a matmul probe timed by CPU time.",
        default=None,
    )


@attrs.define
class CheckpointsArgs:
    """Where and when checkpoints are written, and what a resume restores."""

    checkpoints_path: str = doc("Folder holding one sub-folder per saved step plus latest.txt.", default="checkpoints")
    checkpoint_interval: int = doc("Save every N steps (0 = never, except save_final_state).", default=0)
    save_initial_state: bool = doc("Save step 0 before training.", default=False)
    save_final_state: bool = doc("Save after the last step.", default=True)
    async_save: bool = doc(
        "Write checkpoints in a background thread: the step that saves only copies its pieces to host memory; "
        "latest.txt moves once every rank's files are on disk (docs/performance.md).",
        default=False,
    )
    resume_checkpoint_path: str | None = doc(
        "A checkpoints folder with latest.txt, or one step folder, to resume from; `latest` resumes from this run's "
        "own checkpoints_path when it holds a checkpoint and starts fresh when it is empty (rerun the same command "
        "after a preemption).",
        default=None,
    )
    load_optimizer: bool = doc("Restore optimizer state on resume.", default=True)
    overwrite: bool = doc(
        "A fresh run (no resume path) may replace the checkpoints in checkpoints_path and the logs in "
        "logging.log_dir of an earlier run; false (the default) refuses to start instead.",
        default=False,
    )
    keep_last_n: int | None = doc(
        "Keep only the newest N step folders (older ones are removed after a newer one is complete); null keeps all.",
        default=None,
    )
    load_lr_scheduler: bool = doc(
        "Restore the LR scheduler on resume (false: a fresh warmup and decay start at the resumed step).", default=True
    )
    folder_lock: str = doc(
        "How a run holds checkpoints_path and logging.log_dir while it lives, so that a second run into them is "
        "refused: `auto` (flock on .nanocore-lock in each folder, released by the kernel however the run ends; a "
        "lock file where the file system refuses flock), `flock`, `file` (.nanocore-lock.run naming host, pid and "
        "start time, removed when the run ends: for file systems whose locks are unreliable) or `none` "
        "(docs/checkpoints.md).",
        default="auto",
    )


@attrs.define
class ParallelismArgs:
    """The process layout over its axes (dp, cp, tp, pp and ep) and the plugins that implement it."""

    dp: int = doc("Data-parallel replicas.", default=1)
    tp: int = doc("Tensor-parallel ranks (innermost; same node).", default=1)
    pp: int = doc("Pipeline stages.", default=1)
    pp_engine: str = doc("Pipeline schedule plugin: afab, 1f1b, interleaved, ...", default="1f1b")
    pp_virtual_stages: int = doc("Model chunks per pipeline rank (interleaved schedules).", default=1)
    tp_mode: str = doc(
        "Tensor-parallel mode plugin: ALL_REDUCE or REDUCE_SCATTER (sequence parallel).", default="ALL_REDUCE"
    )
    tp_linear_async_communication: bool = doc("Overlap TP communication with the matmul.", default=False)
    expert_parallel_size: int = doc(
        "Ranks the experts of a mixture-of-experts model are split over, taken from dp x cp (must divide it).",
        default=1,
    )
    context_parallel_size: int = doc(
        "Ranks each sequence is split over (context parallelism, ring attention); the model must declare support.",
        default=1,
    )
    context_parallel_mode: str = doc(
        "How attention crosses the context-parallel ranks: `ring` (key/value blocks travel round the cp ranks) or "
        "`all_to_all` (DeepSpeed-Ulysses: heads split over the cp ranks, each attends over the whole sequence; "
        "needs query heads / tp divisible by context_parallel_size). See docs/context_parallel.md.",
        default="ring",
    )
    recompute_layer: bool = doc(
        "Activation checkpointing per decoder layer (the same as recompute_granularity: full).", default=False
    )
    recompute_granularity: str | None = doc(
        "What to recompute in backward instead of keeping: `full` (each pipeline block but the first and last: "
        "least memory, one more forward) or `selective` (only the modules the model declares, LLaMA's attention "
        "core: little extra compute). Unset: full when recompute_layer is true, else nothing.",
        default=None,
    )

    @property
    def recompute(self) -> str | None:
        """What is recomputed: 'full', 'selective', or None."""
        return self.recompute_granularity or ("full" if self.recompute_layer else None)

    collective_timeout_seconds: float = doc(
        "A collective (all-reduce, send/recv, barrier) that waits longer than this ends the job with an error "
        "instead of hanging: a stalled or dead rank.",
        default=600.0,
    )
    engine: str = doc("Parallel engine plugin that runs the model (built-in: nd, alias 3d).", default="nd")


@attrs.define
class InitMethod:
    """How weights start: random normal with `std`, or loaded from `path` (a checkpoint or model folder)."""

    std: float = doc("Standard deviation of the normal initialisation.", default=0.02)
    scaling_method: str = doc(
        "nanotron compatibility: NUM_LAYERS scales output projections by 1/sqrt(2L).", default="NUM_LAYERS"
    )
    path: str | None = doc("Start from these weights instead of random ones.", default=None)


@attrs.define
class ModelArgs:
    """The model: a plugin-owned `model_config` selected by its `model_type`."""

    model_config: Any = doc("Model plugin's config; `model_type` selects the plugin (nanotron: is_llama_config).")
    model_type: str = doc("Filled from model_config.model_type.", default="llama")
    init_method: InitMethod = doc("Weight initialisation.", factory=InitMethod)
    dtype: str = doc(
        "Parameter dtype: auto (bfloat16 on GPU, float32 on CPU), bfloat16, float16 or float32.", default="auto"
    )
    make_vocab_size_divisible_by: int = doc("Pad the vocabulary to a multiple of this times tp.", default=1)
    ddp_bucket_cap_mb: int = doc("Gradient bucket size for data-parallel reduction.", default=25)
    float8_recipe: str | None = doc(
        "Train linear layers' matmuls in FP8 with this recipe: tensorwise or rowwise (null: off). Outputs, "
        "gradients and weights stay in `dtype` (docs/performance.md).",
        default=None,
    )
    float8_skip: list[str] | None = doc(
        "Module names (fnmatch patterns) kept in high precision under float8_recipe; null: the output head "
        "(the module the model's TP plan marks lm_head). Embeddings, routers and experts are never FP8.",
        default=None,
    )
    compile: bool = doc(
        "Compile each pipeline block (each decoder layer; the embedding; the final norm and head) and the loss "
        "with torch.compile, regionally: layers of one shape share one compiled graph (docs/performance.md).",
        default=False,
    )


@attrs.define
class TokenizerArgs:
    """The tokenizer: a registered name (`byte`) or a local tokenizer.json / tokenizer folder."""

    tokenizer_name_or_path: str | None = doc(
        "`byte`, or a path to tokenizer.json or a tokenizer folder.", default="byte"
    )
    tokenizer_type: str | None = doc(
        "Force a tokenizer plugin; default: the name if registered, else `hf`.", default=None
    )


@attrs.define
class TokensArgs:
    """Batch geometry and run length."""

    sequence_length: int = doc("Tokens per sample.", default=2048)
    train_steps: int = doc("Total optimizer steps.", default=1000)
    micro_batch_size: int = doc("Samples per micro-batch per replica.", default=1)
    batch_accumulation_per_replica: int = doc("Micro-batches per step per replica.", default=1)
    val_check_interval: int = doc("Validate every N steps (-1 or 0 = never).", default=-1)
    limit_val_batches: int = doc("Global batches per validation pass.", default=0)
    document_masking: bool = doc(
        "Packed samples: attention never crosses an end-of-document token and rotary positions restart at each "
        "document (the tokenizer's eos_token_id ends a document).",
        default=False,
    )

    @property
    def global_batch_size_per_replica(self) -> int:
        return self.micro_batch_size * self.batch_accumulation_per_replica


@attrs.define
class LRSchedulerArgs:
    """Warmup then decay to `min_decay_lr`."""

    learning_rate: float = doc("Peak learning rate.", default=3e-4)
    lr_warmup_steps: int = doc("Warmup steps.", default=0)
    lr_warmup_style: str = doc("linear or constant.", default="linear")
    lr_decay_style: str = doc("Decay shape plugin: cosine, linear, 1-sqrt, constant.", default="cosine")
    lr_decay_steps: int | None = doc("Decay length; default train_steps - warmup.", default=None)
    lr_decay_starting_step: int | None = doc("Decay start; default right after warmup.", default=None)
    min_decay_lr: float = doc("Floor reached at the end of decay.", default=0.0)


@attrs.define
class OptimizerFactory:
    """`name` selects an optimizer plugin; the other keys are that plugin's arguments."""

    name: str = doc("Optimizer plugin: adam_w (alias adamW), sgd, ...", default="adam_w")
    args: Any = doc("The plugin's own config (flattened beside `name` in YAML).", default=None)


@attrs.define
class SkipSpikesArgs:
    """The stability guard (nanocore/spike_guard.py): a step whose loss or gradient norm is not finite, or
    a spike above the recent steps', updates nothing; the run stops after `max_consecutive` in a row."""

    enabled: bool = doc(
        "Skip such steps (false: a non-finite loss or gradient norm stops the run at once, before any update; "
        "spikes are applied).",
        default=False,
    )
    sigmas: float = doc(
        "A spike: the loss or the gradient norm more than this many standard deviations above the mean of the "
        "recent accepted steps.",
        default=6.0,
    )
    window: int = doc("How many recent accepted steps the mean and standard deviation are taken over.", default=100)
    min_history: int = doc(
        "Spikes are judged once this many accepted steps are in the window (non-finite values always are).",
        default=20,
    )
    max_consecutive: int = doc(
        "Stop the run, pointing at the last good checkpoint, after this many skipped steps in a row.", default=5
    )


@attrs.define
class OptimizerArgs:
    """Optimizer, its ZeRO stage and the LR schedule."""

    optimizer_factory: OptimizerFactory = doc("Which optimizer, and its arguments.", factory=OptimizerFactory)
    learning_rate_scheduler: LRSchedulerArgs = doc("LR schedule.", factory=LRSchedulerArgs)
    zero_stage: int = doc(
        "0 = replicated optimizer state; 1 = optimizer state sharded over data parallel; 2 = optimizer state "
        "and gradients sharded (gradients reduce-scattered during backward); 3 = parameters sharded too (each "
        "pipeline block gathered around its use). Stages are plugins.",
        default=0,
    )
    weight_decay: float = doc("Decoupled weight decay (not applied to norms and biases).", default=0.0)
    clip_grad: float | None = doc("Clip the global gradient norm to this value.", default=None)
    accumulate_grad_in_fp32: bool = doc("Accumulate gradients in float32 buffers.", default=True)
    skip_spikes: SkipSpikesArgs = doc(
        "A stability guard: steps whose loss or gradient norm is not finite or spikes update nothing "
        "(docs/operations.md).",
        factory=SkipSpikesArgs,
    )


@attrs.define
class DatasetSpec:
    """One dataset: `format` selects the plugin; the other keys are its arguments."""

    format: str = doc("Dataset format plugin: dummy, hf, nanoset, ...", default="dummy")
    args: Any = doc("The format's own config (flattened beside `format` in YAML).", default=None)
    weight: float = doc("Mixture weight when several datasets are listed.", default=1.0)


@attrs.define
class DataArgs:
    """Data for one stage."""

    dataset: list[DatasetSpec] = doc(
        "One dataset, a list (a weighted mixture), or null (the default) for random tokens.",
        factory=lambda: [DatasetSpec("dummy")],
    )
    validation_dataset: list[DatasetSpec] | None = doc(
        "Data for validation passes (same forms as dataset).", default=None
    )
    seed: int | None = doc("Data order seed; default general.seed.", default=None)


@attrs.define
class DatasetStageArgs:
    """A data stage starts at `start_training_step` and runs until the next stage starts."""

    name: str = doc("Stage name.", default="stable")
    start_training_step: int = doc("First step (1-based) that uses this stage.", default=1)
    data: DataArgs = doc("The stage's data.", factory=DataArgs)


@attrs.define
class LoggerSpec:
    """A logger plugin and its options."""

    name: str = doc("Logger plugin: console, jsonl, tensorboard, wandb, ...")
    options: Any = doc("The logger's own config (flattened beside `name` in YAML).", default=None)


@attrs.define
class LoggingArgs:
    """Where metrics go."""

    log_dir: str = doc("metrics.jsonl and TensorBoard files go here.", default="logs")
    loggers: list[LoggerSpec] = doc(
        "Logger plugins (names or {name, ...options}); [] logs nothing.",
        factory=lambda: [LoggerSpec("console"), LoggerSpec("jsonl"), LoggerSpec("tensorboard")],
    )
    log_level: str = doc("Python logging level on rank 0.", default="info")
    log_level_replica: str = doc("Python logging level on other ranks.", default="warning")
    iteration_step_info_interval: int = doc("Log metrics every N steps.", default=1)


@attrs.define
class Config:
    """A whole nanocore run."""

    model: ModelArgs = doc("The model.")
    general: GeneralArgs = doc("Run identity and seed.", factory=GeneralArgs)
    checkpoints: CheckpointsArgs = doc("Checkpointing.", factory=CheckpointsArgs)
    parallelism: ParallelismArgs = doc("Parallel layout.", factory=ParallelismArgs)
    tokenizer: TokenizerArgs = doc("Tokenizer.", factory=TokenizerArgs)
    tokens: TokensArgs = doc("Batch geometry.", factory=TokensArgs)
    optimizer: OptimizerArgs = doc("Optimizer.", factory=OptimizerArgs)
    data_stages: list[DatasetStageArgs] = doc(
        "Data stages, ordered by start_training_step.", factory=lambda: [DatasetStageArgs()]
    )
    logging: LoggingArgs = doc("Logging.", factory=LoggingArgs)
    plugins: list[str] = doc("Local plugin files or modules, relative to this YAML file.", factory=list)

    @property
    def global_batch_size(self) -> int:
        return self.parallelism.dp * self.tokens.micro_batch_size * self.tokens.batch_accumulation_per_replica
