"""Mixtral: LLaMA whose MLPs are sparse mixtures of SwiGLU experts, following `nanocore.moe_api`.

Module and parameter names equal transformers 5's `MixtralForCausalLM` (`mlp.gate.weight` [E, H],
`mlp.experts.gate_up_proj` [E, 2I, H] with the gate rows first, `mlp.experts.down_proj` [E, H, I]),
so its state dict loads without renaming. Options beyond Mixtral add `mlp.shared_experts` (a
`LlamaMLP`) and, for sigmoid routing, `mlp.gate.e_score_correction_bias` [E].

The sparse block sorts its token slots by expert and hands them to the engine's `ExpertRuntime`,
which decides where the experts live; it never reads the expert count from the config, since under
expert parallelism its expert tensors hold only this rank's rows.

Auxiliary losses, per micro-batch and per layer, over the micro-batch's N tokens (every token
shard: statistics go through `runtime.token_sum`), with L = num_hidden_layers, E experts, top-k:

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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanocore import moe_api
from nanocore.model_api import init_normal
from nanocore.moe_api import ExpertRuntime, LocalExperts, MoEStatistics, attach_aux_loss, expert_matmul
from nanocore_plugins.llama.config import MixtralConfig
from nanocore_plugins.llama.model import ACT_FNS, LlamaForCausalLM, LlamaMLP

EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")


class MixtralRouter(nn.Module):
    """The router (`mlp.gate`): logits = x W^T, as transformers' `MixtralTopKRouter` computes them (in
    the model's dtype). Sigmoid routing adds `e_score_correction_bias`, which only picks the experts."""

    def __init__(self, config: MixtralConfig):
        super().__init__()
        experts = config.num_local_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size))
        if config.scoring_func == "sigmoid":
            # Balanced by update_router_bias after each step, never by the optimizer.
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MixtralExperts(nn.Module):
    """Every expert's weights stacked on dim 0 (transformers' fused layout)."""

    def __init__(self, config: MixtralConfig):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act = ACT_FNS[config.hidden_act]

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by local expert (`counts[j]` rows for expert j) -> each through its expert."""
        if len(counts) != self.gate_up_proj.shape[0]:
            raise RuntimeError(
                f"the expert runtime returned rows for {len(counts)} experts; this rank holds "
                f"{self.gate_up_proj.shape[0]}"
            )
        gate, up = expert_matmul(rows, self.gate_up_proj, counts).chunk(2, dim=-1)
        return expert_matmul(self.act(gate) * up, self.down_proj, counts)


class MixtralSparseMoeBlock(nn.Module):
    """`model.layers.N.mlp`: top-k routing over the experts (plus optional shared experts); a
    `nanocore.moe_api.MoELayer`. Works on whatever tokens it gets ([b, s, H], s possibly a shard)."""

    expert_parameters = EXPERT_PARAMETERS

    def __init__(self, config: MixtralConfig):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.aux_coef = config.router_aux_loss_coef
        self.z_coef = config.router_z_loss_coef
        self.bias_update_rate = config.router_bias_update_rate
        self.num_moe_layers = config.num_hidden_layers
        self.gate = MixtralRouter(config)
        self.experts = MixtralExperts(config)
        if config.num_shared_experts:
            self.shared_experts = LlamaMLP(config, config.shared_intermediate_size)
        self.runtime: ExpertRuntime = LocalExperts()
        self._stats: torch.Tensor | None = None  # [E + 3] float64: counts, aux, z, micro-batches

    def set_runtime(self, runtime: ExpertRuntime) -> None:
        self.runtime = runtime

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [n, E] -> (top-k weights [n, k] float32, top-k experts [n, k], the per-token
        probabilities [n, E] float32 the load-balancing loss uses)."""
        if self.scoring_func == "sigmoid":
            scores = torch.sigmoid(logits.float())
            bias = self.gate.e_score_correction_bias.detach().float()
            _, experts = torch.topk(scores + bias, self.top_k, dim=-1)
            weights = scores.gather(1, experts)
            probs = scores / scores.sum(dim=-1, keepdim=True)  # Megatron / DeepSeek's normalised scores
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), experts, probs

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
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
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


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`; lists its
    MoE layers in `moe_layers`."""

    config: MixtralConfig

    def activation_elements_per_token(self) -> None:
        """Routed experts keep a data-dependent share of tokens each: not declared to the planner."""
        return None

    def __init__(
        self,
        config: MixtralConfig,
        *,
        init_std: float = 0.02,
        scale_output_init: bool = True,
        vocab_multiple: int = 1,
    ):
        super().__init__(config, init_std=init_std, scale_output_init=scale_output_init, vocab_multiple=vocab_multiple)
        self.moe_layers = [f"model.layers.{i}.mlp" for i in range(config.num_hidden_layers)]
        # The router and the experts stay whole on every TP rank (experts are split by expert
        # parallelism instead); the shared experts split like LLaMA's MLP.
        self.tp_plan = {k: v for k, v in self.tp_plan.items() if ".mlp." not in k}
        layers = "model.layers.*"
        if config.num_shared_experts:
            self.tp_plan.update(
                {
                    f"{layers}.mlp.shared_experts.gate_proj": "colwise",
                    f"{layers}.mlp.shared_experts.up_proj": "colwise",
                    f"{layers}.mlp.shared_experts.down_proj": "rowwise",
                }
            )

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return MixtralSparseMoeBlock(self.config)

    def active_fraction(self, name: str) -> float:
        """A token runs k of the E experts; the router bias only picks them."""
        if name.endswith(EXPERT_PARAMETERS):
            return self.config.num_experts_per_tok / self.config.num_local_experts
        if name.endswith("e_score_correction_bias"):
            return 0
        return 1

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """LLaMA's rules, plus: experts normal(0, std) (down_proj scaled like LLaMA's), router bias 0.
        Expert tensors are drawn whole ([E, ...]); the engine slices them for expert parallelism."""
        if name.endswith("e_score_correction_bias"):
            tensor.data.zero_()
            return
        if not name.endswith(EXPERT_PARAMETERS):
            super().init_parameter(name, tensor, generator)
            return
        std = self.init_std
        if self.scale_output_init and name.endswith("down_proj"):
            std /= math.sqrt(2 * self.config.num_hidden_layers)
        init_normal(tensor, std, generator)
