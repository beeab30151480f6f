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
marked `hidden_matrix`. The iteration needs the whole matrix, which ZeRO (rows) and tensor
parallelism (columns or rows) split: the ZeRO stage hands this optimizer a `ParamPiece` per tensor
(`takes_pieces`), and each matrix's update is computed once, by an owner among its data-parallel
replicas, from the matrix put back together (`Muon`; docs/optimizers.md).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.optim.adam import adam

from nanocore.config.schema import doc
from nanocore.engine_api import ParamPiece, ReplicaGroup
from nanocore.sharding import Placement, all_gather_single, row_share

KELLER_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
UPDATE_SCALES = ("moonlight", "spectral", "none")
NS_DTYPES = ("auto", "float32", "bfloat16")


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
    ns_dtype: str = doc(
        "dtype of the Newton-Schulz iteration: auto (bfloat16 on CUDA, as the reference implementations run it; "
        "float32 elsewhere, where bfloat16 matmuls are slow), float32 or bfloat16. The momentum and the update "
        "stay in the optimizer's float32.",
        default="auto",
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
        if self.ns_dtype not in NS_DTYPES:
            p.append(f"ns_dtype: must be one of {', '.join(NS_DTYPES)}, got {self.ns_dtype!r}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        return p


def newton_schulz(
    g: torch.Tensor, steps: int, coefficients: tuple[float, float, float], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The approximate orthogonal factor of each matrix in `g` ([..., rows, cols]), in `g`'s dtype,
    iterated in `dtype` (default `g`'s)."""
    a, b, c = coefficients
    x = (g / (g.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype or g.dtype)  # every singular value <= 1
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the wide form: X X^T is then the smaller Gram matrix
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(g.dtype)


def ns_dtype(name: str, device: torch.device) -> torch.dtype:
    """The iteration's dtype for `MuonArgs.ns_dtype` on `device`."""
    if name == "bfloat16" or (name == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def update_scale(kind: str, rows: int, cols: int) -> float:
    if kind == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if kind == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `hidden_matrix`, AdamW (decoupled weight decay) on the others.

    `pieces` (from the ZeRO stage, `nanocore.engine_api.ParamPiece`) says, for every tensor, which
    part of its full parameter it is and which ranks hold the rest; without it every tensor is taken
    as a whole parameter (one process). The update of each hidden matrix is computed once per
    data-parallel group, by an owner (`_Owners`): the replicas' momentum rows are gathered to it, it
    puts the whole matrix together from the tensor-parallel pieces, runs Newton-Schulz, and sends
    each replica the rows of the result it holds (docs/optimizers.md draws it).
    """

    def __init__(
        self, params: Any, lr: float, weight_decay: float, args: MuonArgs, pieces: dict[torch.Tensor, ParamPiece]
    ):
        self.args = args
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "hidden_matrix": False})
        self.pieces = pieces
        self._layouts: dict[torch.Tensor, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        owners = _Owners()
        for group in self.param_groups:
            if group["hidden_matrix"]:
                self._muon(group, owners)
            else:
                self._adamw(group)

    def _piece(self, p: torch.Tensor) -> ParamPiece:
        piece = self.pieces.get(p)
        if piece is None:  # one process: the tensor is its whole parameter
            piece = ParamPiece("", Placement.whole(tuple(p.shape)), tuple(p.shape), None, _ALONE, None, True)
            self.pieces[p] = piece
        return piece

    def _muon(self, group: dict, owners: _Owners) -> None:
        args, lr, wd = self.args, group["lr"], group["weight_decay"]
        coefficients = (args.ns_coefficients[0], args.ns_coefficients[1], args.ns_coefficients[2])
        for p in group["params"]:
            piece = self._piece(p)
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(args.muon_momentum).add_(p.grad)
            u = p.grad.add(buf, alpha=args.muon_momentum) if args.muon_nesterov else buf
            owner = owners.next(piece.replicas)
            whole = _gather_rows(u, piece, owner)  # this piece of the matrix, whole on the owner
            if whole is not None:  # the owner: the full matrix, Newton-Schulz once, back to this piece
                full = self._assemble(p, whole, piece)
                o = newton_schulz(full, args.ns_steps, coefficients, ns_dtype(args.ns_dtype, full.device))
                whole = o[(..., *piece.local_placement.slices(piece.local_shape)[-2:])].contiguous()
            o = _scatter_rows(whole, u, piece, owner)
            if wd:
                p.mul_(1 - lr * wd)
            rows, cols = piece.local_placement.full_shape[-2:]
            p.add_(o, alpha=-lr * update_scale(args.update_scale, rows, cols))

    def _assemble(self, p: torch.Tensor, local: torch.Tensor, piece: ParamPiece) -> torch.Tensor:
        """The full matrices (the last two dims of the full parameter) from every model-parallel
        rank's piece (equal shapes; pieces may repeat, as shared key/value heads do)."""
        mp = piece.model_parallel
        if mp is None or mp.size == 1:
            return local
        gathered = torch.empty(mp.size * local.numel(), dtype=local.dtype, device=local.device)
        all_gather_single(gathered, local.contiguous().view(-1), group=mp.group)
        gathered = gathered.view(mp.size, *local.shape)
        if p not in self._layouts:  # where every rank's piece sits: asked once
            mine = torch.tensor(piece.local_placement.offsets, dtype=torch.int64, device=local.device)
            offsets = torch.empty(mp.size * mine.numel(), dtype=torch.int64, device=local.device)
            all_gather_single(offsets, mine, group=mp.group)
            self._layouts[p] = [(tuple(o), piece.local_shape) for o in offsets.view(mp.size, -1).tolist()]
        lead = local.shape[:-2]
        full = torch.empty((*lead, *piece.local_placement.full_shape[-2:]), dtype=local.dtype, device=local.device)
        for r, (offsets, shape) in enumerate(self._layouts[p]):
            r0, c0 = offsets[-2:]
            full[..., r0 : r0 + shape[-2], c0 : c0 + shape[-1]] = gathered[r]
        return full

    def _adamw(self, group: dict) -> None:
        """torch's AdamW (its functional form, the same state keys as torch.optim.AdamW)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=None,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=self.args.adam_beta1,
            beta2=self.args.adam_beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=self.args.adam_eps,
            maximize=False,
        )


_ALONE = ReplicaGroup(None, 0, 1)


class _Owners:
    """Round-robin owners of the matrices, per data-parallel group: the same sequence on every rank
    (the ranks of a group step the same matrices in the same order)."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def next(self, replicas: ReplicaGroup) -> int:
        key = id(replicas.group)
        n = self.count.get(key, 0)
        self.count[key] = n + 1
        return n % replicas.size


def _global(replicas: ReplicaGroup, rank: int) -> int:
    return dist.get_global_rank(replicas.group, rank) if replicas.group is not None else rank


def _gather_rows(u: torch.Tensor, piece: ParamPiece, owner: int) -> torch.Tensor | None:
    """The piece (`local_shape`) on the owner, None elsewhere: its replicas' rows gathered to the
    owner, or, when every replica holds the whole piece, the owner's own."""
    replicas = piece.replicas
    if replicas.rank != owner and piece.rows is None:
        return None
    if piece.rows is None or replicas.size == 1:
        return u
    shares = [row_share(piece.local_shape, replicas.size, q) for q in range(replicas.size)]
    width = max(length for _, length in shares)
    send = u.new_zeros((width, *u.shape[1:]))
    send[: u.shape[0]] = u
    out = [torch.empty_like(send) for _ in shares] if replicas.rank == owner else None
    dist.gather(send, out, dst=_global(replicas, owner), group=replicas.group)
    if out is None:
        return None
    return torch.cat([chunk[:length] for chunk, (_, length) in zip(out, shares, strict=True)])


def _scatter_rows(whole: torch.Tensor | None, u: torch.Tensor, piece: ParamPiece, owner: int) -> torch.Tensor:
    """This tensor's rows of the owner's result: scattered over the replicas, or the whole piece
    broadcast when every replica holds all of it."""
    replicas = piece.replicas
    if replicas.size == 1:
        assert whole is not None
        return whole
    if piece.rows is None:
        out = whole if whole is not None else torch.empty_like(u)
        dist.broadcast(out, src=_global(replicas, owner), group=replicas.group)
        return out
    shares = [row_share(piece.local_shape, replicas.size, q) for q in range(replicas.size)]
    width = max(length for _, length in shares)
    chunks = None
    if whole is not None:
        chunks = []
        for start, length in shares:
            chunk = whole.new_zeros((width, *whole.shape[1:]))
            chunk[:length] = whole[start : start + length]
            chunks.append(chunk)
    mine = u.new_empty((width, *u.shape[1:]))
    dist.scatter(mine, chunks, src=_global(replicas, owner), group=replicas.group)
    return mine[: u.shape[0]]


def build_muon(
    param_groups: list[dict],
    args: MuonArgs | None,
    *,
    lr: float,
    weight_decay: float,
    device: torch.device,
    pieces: dict[torch.Tensor, ParamPiece] | None = None,
) -> torch.optim.Optimizer:
    """Muon over the groups the engine marks `hidden_matrix`, AdamW over the rest."""
    groups = [dict(g, params=list(g["params"])) for g in param_groups]
    return Muon(groups, lr=lr, weight_decay=weight_decay, args=args or MuonArgs(), pieces=dict(pieces or {}))
