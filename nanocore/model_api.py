"""What a model plugin provides. Models are written single-device style; engines parallelise them.

A model plugin registers `build(model_args: ModelArgs, *, vocab_multiple: int = 1) -> CausalLM`
with its attrs config class; the vocabulary is padded up to a multiple of `vocab_multiple`.
`build` is called under `torch.device("meta")`; the engine materialises the parameters it keeps
and fills each through `init_parameter` as a *full* tensor before slicing it, so any topology
starts from the same weights (docs/parallelism.md, "Order of application", step 4: Materialise).

The contract is the `CausalLM` protocol below: one source of truth. Each member says what it
means; the members named in `OPTIONAL_MEMBERS` may be left out (the value says what happens then),
and `check_model` checks that every other one is there.

Helpers every model plugin can use (the built-in LLaMA/Mixtral and the GPT-2 example do):
`TiedWeightsMixin` (`tie_weights`, and `to_empty` that re-ties), `init_normal` (layout- and
device-independent normal init for `init_parameter`), `count_matmul_parameters` (the N of 6N FLOPs,
with an active share per parameter for sparse models).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypeVar

import attrs
import torch
from torch import nn

from nanocore.sharding import Placement

if TYPE_CHECKING:
    from nanocore.sequence_api import SequenceRuntime

# a TP style: its name, or a dict with the name under "style" and its options (`colwise_kv`: "head_dim")
TPStyle: TypeAlias = str | dict[str, str | int]


class PredictionRuntime(Protocol):
    """What a model's extra prediction heads (DeepSeek-V3's multi-token prediction) ask of the engine
    for the micro-batch being run: the tokens further ahead, and a loss that is the same at any layout."""

    grad_scale: float  # weight of one micro-batch's loss in the step's gradient (for `moe_api.attach_aux_loss`)

    def future_tokens(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, valid), each [b, s] like the model's input on this rank: the token `offset` positions
        after each input position (offset 1 is the label) and whether the sample holds it (ids are 0
        where not)."""
        ...

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean cross-entropy over its valid positions, from logits as the model's output
        head returns them (split over the vocabulary under TP): this rank's share of it (its tokens' sum
        over the micro-batch's whole count), so that the shares add up over the ranks holding other
        tokens of the micro-batch. Differentiable."""
        ...

    def record(self, name: str, value: torch.Tensor) -> None:
        """Report this rank's share of a micro-batch loss under `name`: the step's metric `name` is its
        mean over micro-batches and replicas (declare the names in `prediction_metrics`)."""
        ...


class CausalLM(Protocol):
    """A single-device causal language model, as engines, checkpoints and generation use it."""

    # -- required ---------------------------------------------------------------------------
    vocab_size: int
    """The padded vocabulary size: the embedding's rows (a multiple of `vocab_multiple`)."""

    tp_plan: dict[str, TPStyle]
    """fnmatch pattern on module names -> TP style. Styles: `colwise` (nn.Linear split on
    out_features), `rowwise` (split on in_features, output reduced), `colwise_kv` (like colwise, but
    heads fewer than tp are replicated; give `{"style": "colwise_kv", "head_dim": d}`),
    `vocab_embedding` (nn.Embedding split on rows), `lm_head` (nn.Linear split on rows of the
    vocabulary; its output stays vocab-sharded into the loss). Model code derives head counts from
    tensor shapes (`view(b, s, -1, head_dim)`), never from the config, so that TP works."""

    def forward(self, input_ids: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """input_ids [b, s] (int64) -> logits [b, s, vocab_size]; equal to applying `pipeline_blocks`
        in order. `kv_cache` is for generation (`nanocore generate`)."""
        ...

    def pipeline_blocks(self) -> list[list[str]]:
        """Ordered blocks; each a list of submodule names applied in turn (e.g. `[["model.embed_tokens"],
        ["model.layers.0"], ..., ["model.norm", "lm_head"]]`). The first takes `input_ids`, every module
        maps one tensor to one tensor, the last returns logits. Blocks compute positions from shapes
        (sequence dim = 1), so a pipeline stage needs no extra inputs. Decoder layers should be their
        own blocks (they are the unit of recomputation)."""
        ...

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full tensor for parameter `name` in place, using only `generator` for randomness."""
        ...

    def flops_per_token(self, sequence_length: int) -> float:
        """Training FLOPs (forward + backward) per token."""
        ...

    # -- optional (see OPTIONAL_MEMBERS) ------------------------------------------------------
    true_vocab_size: int
    """The tokenizer's vocabulary before padding; logits at and beyond it are padding the engine masks."""

    tied_parameters: list[tuple[str, str]]
    """Names of parameters that share storage, e.g. `("model.embed_tokens.weight", "lm_head.weight")`."""

    vocab_parameters: list[str]
    """The parameters whose first dimension is the padded vocabulary (either or both names of a tied
    pair). Only their first `true_vocab_size` rows are real; checkpoints store those alone, so that a
    checkpoint written at one tp (one padding) loads at another. Declared rather than read off the TP
    plan: a `vocab_embedding`-style table may index something else (GPT-2's learned positions), and
    the declaration holds at tp = 1, where no plan is applied."""

    init_by_row_blocks: bool
    """True when `init_parameter` depends on the name only (not the tensor's shape or position): an
    engine may then hand it blocks of rows of a large parameter, each with its own generator, so a
    rank builds only the rows it holds (LLaMA does)."""

    selective_recompute_modules: list[str]
    """Name patterns (fnmatch, `*` matches a layer index) of parameter-free modules an engine may
    recompute in backward instead of keeping what they save, under
    `parallelism.recompute_granularity: selective` (LLaMA: `model.layers.*.self_attn.core`, as
    Megatron-LM's selective recompute). Whole-block recompute (`full`) is the engine's alone."""

    moe_layers: list[str]
    """The mixture-of-experts layers, each a `nanocore.moe_api.MoELayer`."""

    def hidden_matrix(self, name: str) -> bool:
        """Whether parameter `name` (of two or more dimensions) is a hidden weight matrix, which matrix
        optimizers (Muon) update as a matrix: attention and MLP projections, each expert's matrices;
        not the vocabulary tables, the output head or a router."""
        ...

    def active_fraction(self, name: str) -> float:
        """The share of parameter `name` a token computes with: k / E for the experts of a top-k router, 0
        for a router's balancing bias, 1 otherwise (the start-of-run summary's active parameters)."""
        ...

    prediction_metrics: list[str]
    """The metrics `set_prediction_runtime`'s heads record (e.g. ["mtp_loss"]), logged beside `lm_loss`."""

    def set_prediction_runtime(self, runtime: PredictionRuntime | None) -> None:
        """Extra prediction heads (multi-token prediction) take their tokens and losses from `runtime`;
        None: they do not run (generation, a single-device forward)."""
        ...

    sequence_features: set[str]
    """What the model supports of `nanocore.sequence_api`: "context_parallel", "document_masking"."""

    def set_sequence_runtime(self, runtime: SequenceRuntime | None) -> None:
        """Attention runs through `runtime` (context parallelism, document masking); None: plain causal."""
        ...

    attention_heads: int
    """Query heads of each attention layer, before TP: all_to_all context parallelism splits them."""

    def activation_elements_per_token(self) -> dict[str, float] | None:
        """What autograd keeps for backward, in elements per token, for `nanocore plan`: `layer_norms`
        (replicated over TP, sequence-sharded under sequence parallelism), `layer_column_inputs` (the
        inputs of column-parallel layers: the gathered sequence under sequence parallelism),
        `layer_sharded` (split over TP), `layer_attention_core_outputs` (the part of `layer_sharded`
        selective recompute does not keep), `head_norm`, `head_logits` (per decoder layer, and for the
        final norm + head block). Optional: `layer_replicated` (whole on every TP rank, for the whole
        sequence even under sequence parallelism: MLA's latent projections and their norms);
        `dense_mlp_sharded` (the MLP's part of `layer_sharded`) with `moe_mlp` (what a sparse MLP keeps,
        per token it gets, at balanced routing: TP does not split experts) and `moe_mlp_sharded` (its
        TP-split part: shared experts) for the layers listed in `moe_layers`; `attention_query` and
        `attention_key_value` (one layer's query and key + value elements: context parallelism's
        buffers, which depend on `context_parallel_mode`) with `attention_kv_heads` (a count, not per
        token: all_to_all repeats key/value heads fewer than cp)."""
        ...


OPTIONAL_MEMBERS: dict[str, str] = {
    "true_vocab_size": "vocab_size: no padding",
    "tied_parameters": "nothing is tied",
    "vocab_parameters": "the vocabulary is never padded (needed when vocab_multiple can pad it)",
    "init_by_row_blocks": "False: each parameter is built whole before it is sliced",
    "selective_recompute_modules": "recompute_granularity: selective is refused",
    "moe_layers": "a dense model",
    "hidden_matrix": "every parameter of two or more dimensions but those in vocab_parameters",
    "active_fraction": "every parameter is active for every token",
    "prediction_metrics": "no extra prediction heads",
    "set_prediction_runtime": "needed only with prediction_metrics",
    "sequence_features": "context parallelism and document masking are refused",
    "set_sequence_runtime": "needed only with sequence_features",
    "attention_heads": "context_parallel_mode: all_to_all is refused",
    "activation_elements_per_token": "nanocore plan reports activations as unknown",
}


def causal_lm_members() -> list[str]:
    """Every member of `CausalLM`, in the order the protocol declares them."""
    names = list(CausalLM.__annotations__)
    names += [n for n, v in vars(CausalLM).items() if callable(v) and not n.startswith("_") and n not in names]
    return names


def required_members() -> list[str]:
    return [n for n in causal_lm_members() if n not in OPTIONAL_MEMBERS]


class KVCache:
    """Per-layer key/value cache for generation. Attention calls `update(layer, k, v)`.

    k and v are [batch, kv_heads, new_tokens, head_dim]; `update` appends and returns the whole
    cached keys and values. `length` is the number of cached positions (the next token's position).
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append and return the cached keys and values followed by the new ones. `keep`: store only
        the last `keep` positions afterwards (a sliding-window layer's next query sees no older key);
        the returned tensors are still every key the new queries may see."""
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        if keep is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer], self.values[layer] = k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :]
        return k, v

    def advance(self, n: int) -> None:
        """Called by the model once per forward, after every layer has updated."""
        self.length += n


M = TypeVar("M", bound="TiedWeightsMixin")


def tie_parameters(model: nn.Module, pairs: Iterable[tuple[str, str]]) -> None:
    """Make the second parameter of each pair the first one (`nn.Module.to_empty` unties shared
    parameters: it replaces each module's separately). The one place nanocore re-ties."""
    for first, second in pairs:
        parent, _, attr = second.rpartition(".")
        setattr(model.get_submodule(parent), attr, model.get_parameter(first))


class TiedWeightsMixin:
    """For a model module (listed before `nn.Module` in its bases) whose `tied_parameters` pairs share
    one Parameter: `tie_weights()` makes each pair one Parameter, and `to_empty` (which unties them,
    as the engine's meta -> real step calls it) ties them again."""

    tied_parameters: list[tuple[str, str]]

    def tie_weights(self) -> None:
        """Make each pair in `tied_parameters` one Parameter: the second name gets the first's."""
        assert isinstance(self, nn.Module), "TiedWeightsMixin is for nn.Module subclasses"
        tie_parameters(self, self.tied_parameters)

    def to_empty(self: M, *, device: torch.device | str | int | None, recurse: bool = True) -> M:
        super().to_empty(device=device, recurse=recurse)  # type: ignore[misc]
        self.tie_weights()
        return self


def init_normal(tensor: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill `tensor` with normal(0, std) values drawn in float32 on the generator's device, so that
    every device and dtype gets the same values from the same generator (for `init_parameter`)."""
    values = torch.empty(tensor.shape, dtype=torch.float32, device=generator.device)
    values.normal_(0.0, std, generator=generator)
    tensor.data.copy_(values)


def count_matmul_parameters(
    model: nn.Module, lookup_tables: Iterable[str] = (), weight: Callable[[str], float] | None = None
) -> float:
    """Parameters a token multiplies with (the N of the 6N FLOPs estimate): every parameter name but
    the `lookup_tables` (embeddings: indexed, not multiplied), a tied pair counted under both names
    (the output head is a real matmul even when it shares the embedding). `weight(name)` scales a
    parameter's count, e.g. k/E for the experts of a top-k router (only the active ones compute).

    Call it in the model's `__init__`, before an engine shards anything."""
    skip = set(lookup_tables)
    total: float = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in skip:
            continue
        total += p.numel() if weight is None else p.numel() * weight(name)
    return total


def check_model(model: nn.Module, model_type: str) -> None:
    from nanocore.errors import PluginError

    missing = [a for a in required_members() if not hasattr(model, a)]
    if missing:
        raise PluginError(
            f"model type {model_type!r} built a module without {', '.join(missing)} "
            "(the contract: nanocore.model_api.CausalLM)"
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in vocab_parameters(model):
        if name not in params or params[name].dim() == 0 or params[name].shape[0] != model.vocab_size:
            found = "no such parameter" if name not in params else f"shape {list(params[name].shape)}"
            raise PluginError(
                f"model type {model_type!r} lists {name!r} in vocab_parameters, but it has {found}; each must be a "
                f"parameter whose first dimension is the padded vocabulary ({model.vocab_size} rows)"
            )


def vocab_parameters(model: nn.Module) -> set[str]:
    """The names the model declares in `vocab_parameters`, with both names of a tied pair (none for a
    model that does not pad its vocabulary)."""
    names = set(getattr(model, "vocab_parameters", ()))
    for first, second in getattr(model, "tied_parameters", ()):
        if first in names or second in names:
            names |= {first, second}
    return names


def is_hidden_matrix(model: nn.Module, name: str, ndim: int) -> bool:
    """`model.hidden_matrix(name)` for a parameter of `ndim` >= 2 dimensions, or the default rule (see
    `CausalLM.hidden_matrix`); never for a vector or a scalar."""
    if ndim < 2:
        return False
    declared = getattr(model, "hidden_matrix", None)
    if declared is not None:
        return bool(declared(name))
    return name not in vocab_parameters(model)


def valid_rows(model: nn.Module, name: str) -> int | None:
    """How many rows of parameter `name` are real: `true_vocab_size` for a vocabulary parameter, else None (all)."""
    if name not in vocab_parameters(model):
        return None
    return int(getattr(model, "true_vocab_size", model.vocab_size))  # type: ignore[arg-type]


def whole_placement(model: nn.Module, name: str, shape: tuple[int, ...]) -> Placement:
    """The placement of parameter `name` held whole (one device), its vocabulary padding marked."""
    return attrs.evolve(Placement.whole(shape), valid_rows=valid_rows(model, name))
