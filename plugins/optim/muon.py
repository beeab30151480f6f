"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for hidden weight matrices; AdamW for
the rest (embeddings, output head, norms, biases, routers), in one optimizer.

For each hidden matrix W (a 2-D weight, or a stack of experts' matrices [E, out, in], each its own
matrix) with gradient G:

    B <- momentum * B + G                      (momentum buffer)
    U <- G + momentum * B  (Nesterov)  or  B
    O <- NewtonSchulz(U)                       (~ the orthogonal factor U V^T of U = U S V^T)
    W <- W (1 - lr wd) - lr * scale(out, in) * O

The quintic iteration and its coefficients (3.4445, -4.7750, 2.0315) are Keller Jordan's ("Muon: An
optimizer for hidden layers in neural networks", 2024, the modded-nanogpt speedrun): five steps push
every singular value of U / ||U||_F into about [0.7, 1.2] rather than to exactly 1, which trains as
well and costs five pairs of matmuls. `update_scale`:

- `moonlight` (default): scale = 0.2 sqrt(max(out, in)), which gives the update the RMS of a typical
  AdamW update, so AdamW's learning rate and weight decay carry over (Liu et al., "Muon is Scalable for
  LLM Training", arXiv:2502.16982, the Moonlight model);
- `spectral`: scale = sqrt(max(1, out / in)) (Keller Jordan's; wants a larger learning rate, ~0.02);
- `none`: scale = 1.

Which parameters are hidden matrices is the model's to say (`CausalLM.hidden_matrix`; by default every
parameter of two or more dimensions but the vocabulary tables); the engine passes them in param groups
marked `hidden_matrix`. The iteration needs the whole matrix: this optimizer runs where each rank holds
whole matrices (one process; data parallelism without ZeRO; pipeline stages; expert parallelism,
whose experts are whole); layouts that split matrices (ZeRO-1/2/3 rows, tensor parallelism) are
refused at config check until the distributed step exists (docs/optimizers.md).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from nanocore.config.schema import doc

KELLER_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
UPDATE_SCALES = ("moonlight", "spectral", "none")


@attrs.define
class MuonArgs:
    """Muon for hidden matrices, AdamW for every other parameter (see plugins/optim/muon.py)."""

    muon_momentum: float = doc("Momentum of the matrices' buffer.", default=0.95)
    muon_nesterov: bool = doc("Nesterov momentum: orthogonalise G + momentum * B instead of B.", default=True)
    ns_steps: int = doc("Newton-Schulz iterations.", default=5)
    ns_coefficients: list[float] = doc(
        "The quintic iteration's (a, b, c): X <- a X + (b A + c A^2) X with A = X X^T (Keller Jordan's).",
        factory=lambda: list(KELLER_COEFFICIENTS),
    )
    update_scale: str = doc(
        "moonlight: 0.2 sqrt(max(out, in)), AdamW's learning rate and weight decay carry over; spectral: "
        "sqrt(max(1, out / in)); none: 1.",
        default="moonlight",
    )
    adam_beta1: float = doc("AdamW's first-moment decay, for the parameters that are not hidden matrices.", default=0.9)
    adam_beta2: float = doc("AdamW's second-moment decay, for the same.", default=0.95)
    adam_eps: float = doc("AdamW's epsilon, for the same.", default=1e-8)

    def check(self, config: Any) -> list[str]:
        p = []
        if not 0.0 <= self.muon_momentum < 1.0:
            p.append(f"muon_momentum: must be in [0, 1), got {self.muon_momentum}")
        if self.ns_steps < 1:
            p.append(f"ns_steps: must be at least 1, got {self.ns_steps}")
        if len(self.ns_coefficients) != 3:
            p.append(f"ns_coefficients: must be three numbers (a, b, c), got {self.ns_coefficients}")
        if self.update_scale not in UPDATE_SCALES:
            p.append(f"update_scale: must be one of {', '.join(UPDATE_SCALES)}, got {self.update_scale!r}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        par, opt = config.parallelism, config.optimizer
        if opt.zero_stage >= 1 or par.tp > 1:
            p.append(
                f"muon needs each hidden matrix whole on a rank: not yet with optimizer.zero_stage {opt.zero_stage} "
                f"or parallelism.tp {par.tp} (they split matrices); use zero_stage 0 and tp 1 (dp, pp, cp and ep "
                "keep matrices whole)"
            )
        return p


def newton_schulz(g: torch.Tensor, steps: int, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """The approximate orthogonal factor of each matrix in `g` ([..., rows, cols]), in `g`'s dtype."""
    a, b, c = coefficients
    x = g / (g.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # every singular value <= 1
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the wide form: X X^T is then the smaller Gram matrix
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def update_scale(kind: str, rows: int, cols: int) -> float:
    if kind == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if kind == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `hidden_matrix`, AdamW (decoupled weight decay) on the others."""

    def __init__(self, params: Any, lr: float, weight_decay: float, args: MuonArgs):
        self.args = args
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "hidden_matrix": False})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            if group["hidden_matrix"]:
                self._muon(group)
            else:
                self._adamw(group)

    def _muon(self, group: dict) -> None:
        args, lr, wd = self.args, group["lr"], group["weight_decay"]
        coefficients = (args.ns_coefficients[0], args.ns_coefficients[1], args.ns_coefficients[2])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(args.muon_momentum).add_(p.grad)
            u = p.grad.add(buf, alpha=args.muon_momentum) if args.muon_nesterov else buf
            o = newton_schulz(u, args.ns_steps, coefficients)
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr * update_scale(args.update_scale, p.size(-2), p.size(-1)))

    def _adamw(self, group: dict) -> None:
        args, lr, wd = self.args, group["lr"], group["weight_decay"]
        beta1, beta2 = args.adam_beta1, args.adam_beta2
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = state["step"].item()
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            if wd:
                p.mul_(1 - lr * wd)
            denom = (v / (1 - beta2**step)).sqrt_().add_(args.adam_eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


def build_muon(
    param_groups: list[dict], args: MuonArgs | None, *, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """Muon over the groups the engine marks `hidden_matrix`, AdamW over the rest."""
    groups = [dict(g, params=list(g["params"])) for g in param_groups]
    return Muon(groups, lr=lr, weight_decay=weight_decay, args=args or MuonArgs())
