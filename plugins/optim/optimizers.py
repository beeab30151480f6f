"""Built-in optimizers: AdamW, SGD and Lion, as `factory(param_groups, args, *, lr, weight_decay, device)`.

`param_groups` is a list of dicts with "params" and optionally "weight_decay" (the trainer puts norms
and biases in a group with weight_decay 0); `lr` and `weight_decay` are the defaults for the groups
that do not override them. The LR is then driven by `nanocore.lr_schedule.LRSchedule` every step.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from nanocore.config.schema import doc

try:  # private in torch, but the same list torch itself checks `fused=True` against
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
except ImportError:  # pragma: no cover - older or newer torch without the helper

    def _get_fused_kernels_supported_devices() -> list[str]:
        return ["cuda"]


@attrs.define
class AdamWArgs:
    """AdamW (decoupled weight decay); the names are nanotron's."""

    adam_beta1: float = doc("Exponential decay of the first-moment (mean) estimate.", default=0.9)
    adam_beta2: float = doc("Exponential decay of the second-moment (variance) estimate.", default=0.95)
    adam_eps: float = doc("Added to the denominator for numerical stability.", default=1e-8)
    torch_adam_is_fused: bool = doc(
        "Use torch's fused AdamW kernel when the device and parameter dtypes support it (CUDA, and CPU in "
        "recent torch); otherwise torch's default (multi-tensor on GPU).",
        default=True,
    )

    def check(self, config: Any) -> list[str]:
        problems = [
            f"{name}: must be in [0, 1), got {value}"
            for name, value in (("adam_beta1", self.adam_beta1), ("adam_beta2", self.adam_beta2))
            if not 0.0 <= value < 1.0
        ]
        if self.adam_eps < 0:
            problems.append(f"adam_eps: must be at least 0, got {self.adam_eps}")
        return problems


@attrs.define
class SGDArgs:
    """Stochastic gradient descent with optional (Nesterov) momentum.

    `optimizer.weight_decay` is applied as an L2 term added to the gradient (torch's SGD), not decoupled.
    """

    momentum: float = doc("Momentum factor (0 = plain SGD).", default=0.0)
    nesterov: bool = doc("Use Nesterov momentum (needs momentum > 0 and dampening 0).", default=False)
    dampening: float = doc("Dampening of the momentum buffer's gradient term.", default=0.0)

    def check(self, config: Any) -> list[str]:
        problems = []
        if self.momentum < 0:
            problems.append(f"momentum: must be at least 0, got {self.momentum}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            problems.append("nesterov: needs momentum > 0 and dampening 0")
        return problems


@attrs.define
class LionArgs:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv:2302.06675): the sign
    of an interpolated momentum, with decoupled weight decay. Its updates are +-lr per element, larger than
    AdamW's: the paper uses a learning rate 3-10x smaller and a weight decay 3-10x larger."""

    lion_beta1: float = doc("Interpolation between the momentum and the gradient for the update's sign.", default=0.9)
    lion_beta2: float = doc("Exponential decay of the momentum.", default=0.99)

    def check(self, config: Any) -> list[str]:
        return [
            f"{name}: must be in [0, 1), got {value}"
            for name, value in (("lion_beta1", self.lion_beta1), ("lion_beta2", self.lion_beta2))
            if not 0.0 <= value < 1.0
        ]


class Lion(torch.optim.Optimizer):
    """Per parameter: c = b1 m + (1 - b1) g; p <- p (1 - lr wd) - lr sign(c); m <- b2 m + (1 - b2) g.
    Elementwise, so it runs on any shard of a parameter as it would on the whole (every ZeRO stage)."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                update = m.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def fused_supported(device: torch.device, param_groups: list[dict]) -> bool:
    """Whether torch has a fused optimizer kernel for `device` and every parameter's dtype."""
    supported = _get_fused_kernels_supported_devices()
    if torch.device(device).type not in supported:
        return False
    return all(
        p.device.type in supported and torch.is_floating_point(p) for group in param_groups for p in group["params"]
    )


def build_adamw(
    param_groups: list[dict], args: AdamWArgs | None, *, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """torch.optim.AdamW, fused when asked for and supported."""
    args = args or AdamWArgs()
    groups = [dict(g, params=list(g["params"])) for g in param_groups]
    fused = args.torch_adam_is_fused and fused_supported(device, groups)
    return torch.optim.AdamW(
        groups,
        lr=lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=weight_decay,
        fused=True if fused else None,
    )


def build_sgd(
    param_groups: list[dict], args: SGDArgs | None, *, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """torch.optim.SGD."""
    args = args or SGDArgs()
    groups = [dict(g, params=list(g["params"])) for g in param_groups]
    return torch.optim.SGD(
        groups,
        lr=lr,
        momentum=args.momentum,
        dampening=args.dampening,
        nesterov=args.nesterov,
        weight_decay=weight_decay,
    )


def build_lion(
    param_groups: list[dict], args: LionArgs | None, *, lr: float, weight_decay: float, device: torch.device
) -> torch.optim.Optimizer:
    """Lion over the groups (see `Lion`)."""
    args = args or LionArgs()
    groups = [dict(g, params=list(g["params"])) for g in param_groups]
    return Lion(groups, lr=lr, betas=(args.lion_beta1, args.lion_beta2), weight_decay=weight_decay)
