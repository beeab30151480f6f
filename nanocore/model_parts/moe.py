"""The sparse mixture-of-experts MLP (a `nanocore.moe_api.MoELayer`) and the decoder LM whose layers
use it: Mixtral's top-k softmax router, Qwen3-MoE's (top-k probabilities kept unnormalised unless
`norm_topk_prob`), DeepSeek-V3-style sigmoid scores with a per-expert balancing bias, optional
shared experts; and the variants of gpt-oss (a router bias, top-k on the logits then a softmax over
the k chosen, experts with biases and a clamped SwiGLU) and Qwen3-Next (a sigmoid gate on the shared
experts' output).

Module and parameter names are transformers 5's (`mlp.gate.weight` [E, H], `mlp.experts.gate_up_proj`
[E, 2I, H] with the gate rows first, `mlp.experts.down_proj` [E, H, I]); the options beyond them add
`mlp.shared_experts` (a `GatedMLP`), for sigmoid routing `mlp.gate.e_score_correction_bias` [E], and:

- `router_bias`: `mlp.gate.bias` [E] (gpt-oss's `mlp.router.bias`);
- `expert_bias`: `mlp.experts.gate_up_proj_bias` [E, 2I] (gate half first, like the weight) and
  `mlp.experts.down_proj_bias` [E, H]. transformers' gpt-oss stores its experts transposed and with
  the gate and up columns interleaved; `gpt_oss_experts_from_hf` / `gpt_oss_experts_to_hf` convert
  (nanocore keeps [E, 2I, H] gate-first for every model, which expert parallelism and grouped GEMMs
  rely on);
- `shared_expert_gate`: `mlp.shared_expert_gate.weight` [1, H] (Qwen3-Next, whose shared MLP
  transformers names `mlp.shared_expert`).

The block sorts its token slots by expert and hands them to the engine's `ExpertRuntime`, which
decides where the experts live; it never reads the expert count from the config, since under expert
parallelism its expert tensors hold only this rank's rows.

Auxiliary losses, per micro-batch and per MoE layer, over the micro-batch's N tokens (every token
shard: statistics go through `runtime.token_sum`), with L MoE layers, E experts, top-k:

    aux_l = (E / L) * sum_i (c_i / N) * (P_i / N)      c_i: slots routed to expert i (each token
                                                        counts k times), P_i: sum over tokens of the
                                                        softmax probability of expert i
    z_l   = (1 / L) * sum_tokens logsumexp(logits)^2 / N

Summed over layers (as the engine reports them) this is the mean over layers of transformers'
`load_balancing_loss_func` computed layer by layer; it equals transformers' value for one layer. For
several layers transformers concatenates all layers' logits first, E * (mean_l f_l) . (mean_l P_l),
which has cross-layer products no layer can compute alone (a pipeline stage holds a few layers); the
two agree when every layer routes alike, and both are k at perfect balance. The gradient flows
through this rank's probabilities only (c / N is a constant), so the ranks' shares add up to the
gradient of the whole micro-batch's loss.

With gpt-oss's routing (`scoring_func="topk_softmax"`) P_i is still the softmax over all E experts
of the full logits (router bias included) and c_i counts the top-k of the logits, which are the
top-k of that softmax: exactly what transformers' `load_balancing_loss_func` computes from the
router logits gpt-oss records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from nanocore import moe_api
from nanocore.model_api import TPStyle, init_normal
from nanocore.model_parts.config import DecoderConfig
from nanocore.model_parts.decoder import DecoderLM
from nanocore.model_parts.layers import ACT_FNS, GatedMLP, mlp_tp_plan
from nanocore.moe_api import ExpertRuntime, LocalExperts, MoEStatistics, attach_aux_loss, expert_matmul

EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
# `expert_bias`: also stacked by expert on dim 0, so expert parallelism splits them like the weights.
EXPERT_BIAS_PARAMETERS = ("experts.gate_up_proj_bias", "experts.down_proj_bias")
# What the Mixtral-style configs may choose; gpt-oss's routing is `scoring_func="topk_softmax"`.
SCORING_FUNCS = ("softmax", "sigmoid")


@attrs.frozen
class MoESpec:
    """What a sparse MLP block is, whatever a model's config calls it."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's width
    hidden_act: str = "silu"
    scoring_func: str = "softmax"  # softmax | sigmoid | topk_softmax (gpt-oss: top-k logits, then their softmax)
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0  # sigmoid routing: the balancing bias's step
    num_moe_layers: int = 1  # L in the auxiliary losses
    shared_intermediate_size: int = 0  # 0: no shared experts
    n_group: int = 1  # group-limited routing (DeepSeek-V3): experts in n_group groups of equal size,
    topk_group: int = 1  # a token picks the topk_group best groups, then its top-k experts inside them
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by it
    router_bias: bool = False  # gpt-oss: logits = x W^T + b (`gate.bias`, trained)
    expert_bias: bool = False  # gpt-oss: each expert's gate/up and down projections have a bias
    swiglu_limit: float | None = None  # None: act(gate) * up; a number: gpt-oss's clamped SwiGLU (see
    swiglu_alpha: float = 1.702  # `clamped_swiglu`), replacing hidden_act in the routed experts
    shared_expert_gate: bool = False  # Qwen3-Next: shared experts' output times sigmoid(x W_g^T), W_g [1, H]


def expert_problems(experts: int, top_k: int, ep: int, experts_field: str) -> list[str]:
    """Problems ('field: message') with `experts` routed experts, `top_k` per token, split over `ep`
    expert-parallel ranks; `experts_field` is the config's name for the expert count."""
    p = []
    if experts < 1:
        p.append(f"{experts_field}: must be at least 1, got {experts}")
    if top_k < 1:
        p.append(f"num_experts_per_tok: must be at least 1, got {top_k}")
    elif experts >= 1 and top_k > experts:
        p.append(f"num_experts_per_tok: {top_k} is above {experts_field}={experts}")
    if experts >= 1 and ep > 1 and experts % ep:
        p.append(
            f"{experts_field}: {experts} experts cannot be split over parallelism.expert_parallel_size = {ep} "
            "ranks; choose an expert_parallel_size that divides the number of experts"
        )
    return p


class TopKRouter(nn.Module):
    """The router (`mlp.gate`): logits = x W^T (+ b with `router_bias`, gpt-oss), in the model's dtype
    as transformers computes them. Sigmoid routing adds `e_score_correction_bias`, which only picks
    the experts (unlike `bias`, which is trained and shifts every logit)."""

    bias: nn.Parameter | None

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden_size))
        # None (nn.Linear's way) keeps the state dict of a router without one unchanged.
        self.register_parameter("bias", nn.Parameter(torch.zeros(spec.num_experts)) if spec.router_bias else None)
        if spec.scoring_func == "sigmoid":
            # Balanced by update_router_bias after each step, never by the optimizer.
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation, as transformers' `GptOssExperts._apply_gate` computes it: the gate clamped
    above at `limit`, up clamped to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate). The clamps
    keep the product bounded (the gate is unbounded below, where sigmoid sends it to 0)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def _per_row(bias: torch.Tensor, counts: list[int], rows: int) -> torch.Tensor:
    """Each local expert's bias row repeated for the rows it got: [rows, d], to add to its outputs."""
    repeats = torch.tensor(counts, device=bias.device, dtype=torch.int64)
    return torch.repeat_interleave(bias, repeats, dim=0, output_size=rows)


class StackedExperts(nn.Module):
    """Every expert's weights stacked on dim 0 (transformers' fused layout), with `expert_bias` their
    biases too (gpt-oss), stacked the same way so that expert parallelism splits them alike."""

    gate_up_proj_bias: nn.Parameter | None
    down_proj_bias: nn.Parameter | None

    def __init__(self, spec: MoESpec):
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.register_parameter("gate_up_proj_bias", nn.Parameter(torch.zeros(e, 2 * i)) if spec.expert_bias else None)
        self.register_parameter("down_proj_bias", nn.Parameter(torch.zeros(e, h)) if spec.expert_bias else None)
        self.act = ACT_FNS[spec.hidden_act]
        self.swiglu_limit, self.swiglu_alpha = spec.swiglu_limit, spec.swiglu_alpha

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (`counts[j]` rows for expert j) -> each through its expert."""
        if len(counts) != self.gate_up_proj.shape[0]:
            raise RuntimeError(
                f"the expert runtime returned rows for {len(counts)} experts; this rank holds "
                f"{self.gate_up_proj.shape[0]}"
            )
        gate_up = expert_matmul(rows, self.gate_up_proj, counts)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + _per_row(self.gate_up_proj_bias, counts, rows.shape[0])
        gate, up = gate_up.chunk(2, dim=-1)
        if self.swiglu_limit is None:
            act: Callable[[torch.Tensor], torch.Tensor] = self.act
            hidden = act(gate) * up
        else:
            hidden = clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha)
        out = expert_matmul(hidden, self.down_proj, counts)
        if self.down_proj_bias is not None:
            out = out + _per_row(self.down_proj_bias, counts, rows.shape[0])
        return out


class SparseMoeBlock(nn.Module):
    """`model.layers.N.mlp`: top-k routing over the experts (plus optional shared experts); a
    `nanocore.moe_api.MoELayer`. Works on whatever tokens it gets ([b, s, H], s possibly a shard)."""

    expert_parameters: tuple[str, ...] = EXPERT_PARAMETERS

    def __init__(self, spec: MoESpec):
        super().__init__()
        if spec.scoring_func == "topk_softmax" and spec.n_group > 1:
            raise ValueError("group-limited routing (n_group > 1) is defined for softmax and sigmoid scores only")
        if spec.shared_expert_gate and not spec.shared_intermediate_size:
            raise ValueError("shared_expert_gate needs shared experts (shared_intermediate_size > 0)")
        if spec.expert_bias:  # what expert parallelism splits on dim 0 (`shard_experts`)
            self.expert_parameters = EXPERT_PARAMETERS + EXPERT_BIAS_PARAMETERS
        self.num_experts = spec.num_experts
        self.top_k = spec.top_k
        self.scoring_func = spec.scoring_func
        self.norm_topk_prob = spec.norm_topk_prob
        self.aux_coef = spec.aux_loss_coef
        self.z_coef = spec.z_loss_coef
        self.bias_update_rate = spec.bias_update_rate
        self.num_moe_layers = spec.num_moe_layers
        self.n_group, self.topk_group, self.routed_scaling_factor = (
            spec.n_group,
            spec.topk_group,
            spec.routed_scaling_factor,
        )
        self.gate = TopKRouter(spec)
        self.experts = StackedExperts(spec)
        if spec.shared_intermediate_size:
            self.shared_experts = GatedMLP(spec.hidden_size, spec.shared_intermediate_size, spec.hidden_act)
        if spec.shared_expert_gate:  # whole on every TP rank, like the router
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        self.runtime: ExpertRuntime = LocalExperts()
        self._stats: torch.Tensor | None = None  # [E + 3] float64: counts, aux, z, micro-batches

    def set_runtime(self, runtime: ExpertRuntime) -> None:
        self.runtime = runtime

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [n, E] -> (top-k weights [n, k] float32, top-k experts [n, k], the per-token
        probabilities [n, E] float32 the load-balancing loss uses).

        `topk_softmax` (gpt-oss) is softmax routing renormalised over the chosen experts in exact
        arithmetic, but transformers computes it in the logits' dtype (top-k of the logits, softmax
        over those k in the model dtype), which is kept here: under bfloat16 the float32 renormalised
        weights would differ from gpt-oss's by up to a bfloat16 rounding. The weights already sum to
        1, so `norm_topk_prob` does not apply."""
        if self.scoring_func == "topk_softmax":
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1).float()  # float32 holds the model dtype's values exactly
            probs = torch.softmax(logits.float(), dim=-1)  # over every expert, as load_balancing_loss_func
        elif self.scoring_func == "sigmoid":
            scores = torch.sigmoid(logits.float())
            bias = self.gate.e_score_correction_bias.detach().float()
            _, experts = torch.topk(self._group_limited(scores + bias), self.top_k, dim=-1)
            weights = scores.gather(1, experts)
            probs = scores / scores.sum(dim=-1, keepdim=True)  # Megatron / DeepSeek's normalised scores
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            weights, experts = torch.topk(self._group_limited(probs), self.top_k, dim=-1)
            weights = probs.gather(1, experts)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights, experts, probs

    def _group_limited(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` [n, E] with the experts outside each token's `topk_group` best groups at -inf; a
        group's score is the sum of its two best experts' (DeepSeek-V3). Unchanged for one group."""
        if self.n_group <= 1:
            return choice
        n, e = choice.shape
        grouped = choice.view(n, self.n_group, e // self.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(n, e), float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        weights, experts, probs = self.route(logits)
        num_experts = logits.shape[-1]

        # Token slots sorted by expert (stable: a token's slots keep their order within an expert).
        expert_of_slot = experts.reshape(-1)
        order = torch.argsort(expert_of_slot, stable=True)
        token_of_slot = order // self.top_k
        counts = torch.bincount(expert_of_slot, minlength=num_experts)
        y = self._routed_experts(flat.index_select(0, token_of_slot), counts)
        # Weighted in float32 and summed in the input dtype, as transformers does.
        y = (y * weights.reshape(-1)[order, None]).to(flat.dtype)
        out = torch.zeros_like(flat).index_add(0, token_of_slot, y)
        if hasattr(self, "shared_experts"):  # on x's shape: TP layers split and gather along the sequence (dim 1)
            shared = self.shared_experts(x)
            if hasattr(self, "shared_expert_gate"):  # Qwen3-Next: a per-token gate in the model dtype
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared.reshape(flat.shape)
        if self.training and torch.is_grad_enabled():
            out = self._auxiliary_losses(out, logits, probs, counts)
        return out.view_as(x)

    @torch.compiler.disable
    def _routed_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Token rows sorted by expert -> each through its expert, back in the same order. Eager in a
        compiled layer (`model.compile`): how many rows reach each expert changes every step, and a
        compiled graph would be re-traced for each new split."""
        rows, local_counts, handle = self.runtime.dispatch(rows, counts)
        return self.runtime.combine(self.experts(rows, local_counts), handle)

    def _auxiliary_losses(
        self, out: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Attach the load-balancing and z-loss gradients to `out` and record the statistics (see the
        module docstring for the definitions)."""
        num_experts = counts.numel()
        prob_sum = probs.sum(dim=0)
        lse_sq_sum = torch.logsumexp(logits.float(), dim=-1).pow(2).sum()
        local = torch.cat(
            [
                counts.to(torch.float64),
                prob_sum.detach().to(torch.float64),
                lse_sq_sum.detach().to(torch.float64).reshape(1),
                torch.tensor([float(logits.shape[0])], dtype=torch.float64, device=counts.device),
            ]
        )
        total = self.runtime.token_sum(local)  # a collective: called on every forward, recomputation too
        global_counts, global_probs = total[:num_experts], total[num_experts : 2 * num_experts]
        tokens = total[-1].clamp_min(1)
        share = 1.0 / self.num_moe_layers
        fraction = (global_counts / tokens).to(prob_sum.dtype)
        tokens_f = tokens.to(prob_sum.dtype)
        aux_local = share * num_experts * (fraction * prob_sum).sum() / tokens_f
        z_local = share * lse_sq_sum / tokens_f
        loss = self.aux_coef * aux_local + self.z_coef * z_local
        if self.aux_coef or self.z_coef:
            out = attach_aux_loss(out, loss, self.runtime.grad_scale)
        if not moe_api.recomputing():
            aux = share * num_experts * (global_counts / tokens * global_probs / tokens).sum()
            z = share * total[2 * num_experts] / tokens
            row = torch.cat([global_counts, aux.reshape(1), z.reshape(1), total.new_ones(1)])
            self._stats = row if self._stats is None else self._stats + row
        return out

    def pop_statistics(self) -> MoEStatistics | None:
        """The statistics recorded since the last call (None if no training forward ran), then reset."""
        if self._stats is None:
            return None
        stats, self._stats = self._stats.cpu(), None
        e = self.num_experts
        return MoEStatistics(
            tokens_per_expert=stats[:e].clone(),
            aux_loss=float(stats[e]) if self.aux_coef else None,
            z_loss=float(stats[e + 1]) if self.z_coef else None,
            micro_batches=int(stats[e + 2]),
        )

    def update_router_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Sigmoid routing (DeepSeek-V3): after an optimizer step, move each expert's bias toward
        balance by a fixed step: bias_e += rate * sign(mean load - load_e). A no-op for softmax."""
        bias = getattr(self.gate, "e_score_correction_bias", None)
        if bias is None:
            return
        load = tokens_per_expert.to(device=bias.device, dtype=torch.float64)
        with torch.no_grad():
            bias.add_((self.bias_update_rate * torch.sign(load.mean() - load)).to(bias.dtype))


class MoEDecoderLM(DecoderLM):
    """A `DecoderLM` whose MLPs are `SparseMoeBlock`s where `is_sparse_layer(i)` (dense `GatedMLP`s
    elsewhere); lists them in `moe_layers`. A model type gives `sparse_block()` from its config."""

    def sparse_block(self) -> MoESpec:
        """The sparse block, as the model type's config says (its `num_moe_layers` is counted here)."""
        raise NotImplementedError

    def moe_spec(self) -> MoESpec:
        """`sparse_block()` with L in the auxiliary losses set to the decoder's sparse layers."""
        sparse = sum(self.is_sparse_layer(i) for i in range(self.config.num_hidden_layers))
        return attrs.evolve(self.sparse_block(), num_moe_layers=max(sparse, 1))

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return True

    def dense_intermediate_size(self) -> int:
        """The width of the dense layers' MLP."""
        return self.config.intermediate_size

    def __init__(
        self, config: DecoderConfig, *, init_std: float = 0.02, scale_output_init: bool = True, vocab_multiple: int = 1
    ):
        super().__init__(config, init_std=init_std, scale_output_init=scale_output_init, vocab_multiple=vocab_multiple)
        sparse = [i for i in range(config.num_hidden_layers) if self.is_sparse_layer(i)]
        self.moe_layers = [f"model.layers.{i}.mlp" for i in sparse]
        # The router and the experts stay whole on every TP rank (experts are split by expert
        # parallelism instead); shared experts and dense layers' MLPs split like LLaMA's MLP.
        spec = self.moe_spec()
        self.tp_plan = {k: v for k, v in self.tp_plan.items() if ".mlp." not in k}
        self.tp_plan.update(self._mlp_tp_plan(sparse, bool(spec.shared_intermediate_size)))

    def _mlp_tp_plan(self, sparse: list[int], shared: bool) -> dict[str, TPStyle]:
        plan: dict[str, TPStyle] = {}
        dense = [i for i in range(self.config.num_hidden_layers) if i not in sparse]
        prefixes = [f"model.layers.{i}.mlp" for i in dense]
        if shared:
            prefixes.append("model.layers.*.mlp.shared_experts")
        for prefix in prefixes:
            plan.update(mlp_tp_plan(prefix))
        return plan

    def make_mlp(self, layer_idx: int) -> nn.Module:
        if self.is_sparse_layer(layer_idx):
            return SparseMoeBlock(self.moe_spec())
        return GatedMLP(self.config.hidden_size, self.dense_intermediate_size(), self.config.hidden_act)

    def active_fraction(self, name: str) -> float:
        """A token runs k of the E experts (their biases too); the balancing bias only picks them."""
        if name.endswith(EXPERT_PARAMETERS + EXPERT_BIAS_PARAMETERS):
            spec = self.moe_spec()
            return spec.top_k / spec.num_experts
        if name.endswith("e_score_correction_bias"):
            return 0
        return 1

    def hidden_matrix(self, name: str) -> bool:
        """The decoder's rule, less the expert biases ([E, d]: a vector per expert, not a matrix) and
        the shared experts' gate ([1, H], a router of one output)."""
        if name.endswith(EXPERT_BIAS_PARAMETERS) or name.endswith(".mlp.shared_expert_gate.weight"):
            return False
        return super().hidden_matrix(name)

    def activation_elements_per_token(self) -> dict[str, float] | None:
        """The decoder's figures plus what a sparse MLP keeps per token it gets, assuming balanced
        routing (each token's k slots; under expert parallelism a rank's experts then get as many rows
        as it sends): router logits and float32 scores, the k gathered rows, each slot's gate, up,
        silu(gate) and product (gpt-oss's clamped SwiGLU: gate and up, the clamped gate, its sigmoid,
        up + 1 and the gated product, 7I), and its output before weighting; shared experts like a
        dense MLP, their gate's sigmoid and the output it scales."""
        declared = super().activation_elements_per_token()
        if declared is None:
            return None
        spec = self.moe_spec()
        k, h, i = spec.top_k, spec.hidden_size, spec.intermediate_size
        per_slot = 4 * i if spec.swiglu_limit is None else 7 * i
        declared["moe_mlp"] = (
            2 * spec.num_experts + 2 * k * h + k * per_slot + (h + 1 if spec.shared_expert_gate else 0)
        )
        declared["moe_mlp_sharded"] = 4 * spec.shared_intermediate_size
        return declared

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """The decoder's rules, plus: experts normal(0, std) (down_proj scaled like the dense one's),
        router biases and expert biases 0. Expert tensors are drawn whole ([E, ...]); the engine slices
        them for expert parallelism."""
        if name.endswith(("e_score_correction_bias", *EXPERT_BIAS_PARAMETERS)):
            tensor.data.zero_()
            return
        if not name.endswith(EXPERT_PARAMETERS):
            super().init_parameter(name, tensor, generator)
            return
        std = self.init_std
        if self.scale_output_init and name.endswith("down_proj"):
            std /= math.sqrt(2 * self.config.num_hidden_layers)
        init_normal(tensor, std, generator)


# -- gpt-oss's expert layout ---------------------------------------------------------------------
# transformers' GptOssExperts computes x @ W (not x W^T) and interleaves the gate and up columns:
#   gate_up_proj [E, H, 2I] (column 2j: gate j, 2j + 1: up j), gate_up_proj_bias [E, 2I] (the same),
#   down_proj [E, I, H], down_proj_bias [E, H] (as nanocore's).
# nanocore: gate_up_proj [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up), gate_up_proj_bias [E, 2I] (gate
# half first), down_proj [E, H, I]. Only values move, so both directions are bit-exact. Names are
# left alone (the HF mapping renames `router.` to `gate.`); the original openai checkpoints store
# MXFP4 blocks and scales, which must be dequantised to these tensors first.
GPT_OSS_EXPERT_TENSORS = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj")


def _gpt_oss_expert_tensor(name: str) -> str | None:
    """Which of `GPT_OSS_EXPERT_TENSORS` `name` is (itself or under a prefix), or None."""
    return next((t for t in GPT_OSS_EXPERT_TENSORS if name == t or name.endswith("." + t)), None)


def _interleave(fused: torch.Tensor) -> torch.Tensor:
    """Last axis (gate half, up half) -> (gate 0, up 0, gate 1, up 1, ...)."""
    gate, up = fused.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _deinterleave(mixed: torch.Tensor) -> torch.Tensor:
    """Last axis (gate 0, up 0, gate 1, up 1, ...) -> (gate half, up half)."""
    return torch.cat([mixed[..., 0::2], mixed[..., 1::2]], dim=-1)


def _gpt_oss_convert(state: Mapping[str, torch.Tensor], to_hf: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        kind = _gpt_oss_expert_tensor(name)
        want = 2 if kind == "experts.gate_up_proj_bias" else 3
        if kind is not None and tensor.dim() != want:
            raise ValueError(f"{name}: expected {want} dimensions (experts first), got shape {tuple(tensor.shape)}")
        fused = -1 if kind != "experts.gate_up_proj" else (1 if to_hf else -1)
        if kind is not None and kind != "experts.down_proj" and tensor.shape[fused] % 2:
            raise ValueError(f"{name}: the fused gate/up axis has an odd length, shape {tuple(tensor.shape)}")
        if kind == "experts.down_proj":  # [E, I, H] <-> [E, H, I]
            tensor = tensor.transpose(1, 2)
        elif kind == "experts.gate_up_proj":  # HF [E, H, 2I] interleaved <-> nanocore [E, 2I, H] gate half first
            tensor = _interleave(tensor.transpose(1, 2)) if to_hf else _deinterleave(tensor).transpose(1, 2)
        elif kind == "experts.gate_up_proj_bias":  # [E, 2I], interleaved <-> gate half first
            tensor = _interleave(tensor) if to_hf else _deinterleave(tensor)
        out[name] = tensor.contiguous() if kind is not None else tensor
    return out


def gpt_oss_experts_from_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' gpt-oss expert tensors -> nanocore's layout (see above), for every name ending in
    one of `GPT_OSS_EXPERT_TENSORS` (one layer's `mlp.` state or a whole model's); other tensors, the
    down-projection bias among them, pass through unchanged."""
    return _gpt_oss_convert(state, to_hf=False)


def gpt_oss_experts_to_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `gpt_oss_experts_from_hf`: nanocore's expert tensors -> transformers' gpt-oss layout."""
    return _gpt_oss_convert(state, to_hf=True)
