"""Tensor parallelism equals the dense model: outputs, loss and every gradient, in both TP modes.

One spawn per tp size runs every (mode, async, kv heads) combination on a tiny
"attention + MLP" language model, because starting ranks costs far more than the models do.
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanocore.plugins import PluginSet
from nanocore.sharding import get_placement
from nanocore_plugins.parallel.loss import vocab_parallel_cross_entropy
from nanocore_plugins.parallel.tensor_parallel import (
    VocabParallelLMHead,
    parallelize,
    set_tp_mode,
    tp_grad_sync,
    tp_owned_parameters,
)
from nanocore_plugins.tp_modes import comm
from nanocore_plugins.tp_modes import plugin as tp_modes_plugin
from nanocore_plugins.tp_modes.modes import AllReduceMode, ReduceScatterMode
from tests.helpers.compare import rel_diff
from tests.helpers.distributed import RankFailed, run_ranks

HIDDEN, HEADS, HEAD_DIM, FFN = 16, 4, 4, 32
TRUE_VOCAB, PADDED_VOCAB = 13, 16  # 3 padding columns: the last shard at tp=4 is mostly padding
BATCH, SEQ = 2, 8
# Relative tolerance (`rel_diff`: a tensor's max difference over its max magnitude) for everything
# TP computes in another order than the dense model: logits, loss, gradients, the squared grad norm.
# One float32 reduction of the lengths here (<= 32: HIDDEN, FFN, BATCH x SEQ) is off by up to
# 32 eps ~ 4e-6 of its terms' size, typically sqrt(32) eps ~ 7e-7; the squared norm sums ~5k terms
# in torch's blocked summation (log-depth error, ~1e-6). Measured: <= 1.7e-6 for every gradient and
# 3e-7 for the squared norm (whose absolute difference, 2e-5 at a size of 60, is what an absolute
# tolerance tripped on). A wrong gradient is off by O(1) relative: a missing reduction drops the other
# ranks' share, a double-counted one is off by 0.5 (`rel_diff` of g and 2g).
TOL = 1e-5
TP_PLAN = {
    "embed_tokens": "vocab_embedding",
    "layers.*.attn.q_proj": "colwise",
    "layers.*.attn.[kv]_proj": {"style": "colwise_kv", "head_dim": HEAD_DIM},
    "layers.*.attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "lm_head": "lm_head",
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, kv_heads: int):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM)
        self.v_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[:2]  # under sequence parallelism x holds s/tp tokens, q all of them
        q, k, v = (t.view(b, s, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, kv_heads: int):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(HIDDEN), Attention(kv_heads)
        self.mlp_norm, self.mlp = RMSNorm(HIDDEN), MLP()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class ToyLM(nn.Module):
    def __init__(self, kv_heads: int, tied: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(PADDED_VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer(kv_heads) for _ in range(2)])
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, PADDED_VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _data():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=gen)
    labels[0, :2] = -100  # ignored positions do not count
    return ids, labels


def _to_meta(model: nn.Module) -> nn.Module:
    """Move parameters to meta keeping tied ones tied (`Module.to` would untie them; `with
    torch.device("meta")` costs seconds of imports on first use, per rank)."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in moved:
                moved[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"))
            setattr(module, name, moved[id(param)])
    return model


def _grad_diff(name: str, grad: torch.Tensor, ref_grads: dict[str, torch.Tensor], where) -> float:
    """`rel_diff` of a (sharded) gradient from the dense one; a bias at least at its weight's gradient scale.

    k_proj's bias gets a gradient of exactly zero in exact arithmetic (softmax ignores the same shift
    q.b added to all of a query's scores), so in floats it is rounding noise of the size of the
    cancelled terms, dL/dk, which its weight's gradient sums too (times normalised inputs ~1).
    """
    scale = ref_grads[name.removesuffix("bias") + "weight"].abs().max().item() if name.endswith(".bias") else 0.0
    return rel_diff(grad, ref_grads[name][where], scale=scale)


def _check_model(rank: int, tp: int, mode, async_comm: bool, kv_heads: int, tied: bool) -> dict[str, float]:
    """Relative differences (`rel_diff`) between this rank's TP run and the dense model, keyed by what was compared."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    dense = ToyLM(kv_heads, tied)
    ids, labels = _data()
    sharded = copy.deepcopy(dense)
    parallelize(sharded, TP_PLAN, group, mode, async_comm)

    ref_logits = dense(ids)
    ref_loss = F.cross_entropy(ref_logits[..., :TRUE_VOCAB].reshape(-1, TRUE_VOCAB), labels.reshape(-1))
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in dense.named_parameters()}

    logits = sharded(ids)
    head = sharded.lm_head
    assert isinstance(head, VocabParallelLMHead) and logits.shape == (BATCH, SEQ, PADDED_VOCAB // tp)
    loss = vocab_parallel_cross_entropy(logits, labels, group, head.vocab_start, TRUE_VOCAB)
    loss.backward()
    tp_grad_sync(sharded, group)

    diffs = {"loss": rel_diff(loss.item(), ref_loss.item())}
    diffs["logits"] = rel_diff(logits, ref_logits[..., head.vocab_start : head.vocab_start + logits.shape[-1]])
    params = dict(sharded.named_parameters())
    assert params.keys() == ref_grads.keys(), "parameter names must stay those of the dense model"
    assert (sharded.lm_head.weight is sharded.embed_tokens.weight) == tied
    for name, param in params.items():
        where = get_placement(param).slices(tuple(param.shape))
        diffs[f"grad {name}"] = _grad_diff(name, param.grad, ref_grads, where)
        # parallelize copies slices of the dense values: bitwise equal, not just close
        assert torch.equal(param.detach(), dict(dense.named_parameters())[name].detach()[where]), f"value {name}"

    # Each element counted once over TP: the global gradient norm is the dense one.
    norm_sq = torch.stack([p.grad.pow(2).sum() for _, p in tp_owned_parameters(sharded, group)]).sum()
    dist.all_reduce(norm_sq, group=group)
    dense_sq = sum(g.pow(2).sum() for g in ref_grads.values())
    diffs["grad norm^2"] = rel_diff(norm_sq.item(), dense_sq.item())

    # A meta-built model parallelises to the same shapes and placements (the engine's path).
    meta = _to_meta(ToyLM(kv_heads, tied))
    parallelize(meta, TP_PLAN, group, mode, async_comm)
    for name, param in meta.named_parameters():
        assert param.is_meta and param.shape == params[name].shape, name
        assert get_placement(param) == get_placement(params[name]), name

    # Generation switches a sequence-parallel model to ALL_REDUCE: 3 tokens cannot be split over tp.
    set_tp_mode(sharded, AllReduceMode())
    with torch.no_grad():
        short = sharded(ids[:, :3])
    diffs["short logits"] = rel_diff(short, ref_logits[:, :3, head.vocab_start : head.vocab_start + short.shape[-1]])
    return diffs


def _model_parity_rank(rank: int, world_size: int, kv_options: tuple[int, ...]) -> dict[str, float]:
    diffs = {}
    for mode in (AllReduceMode(), ReduceScatterMode()):
        for async_comm in (False, True):
            for kv_heads in kv_options:
                tied = not async_comm  # both tied and untied in each mode, at half the cost
                label = f"{mode.name} async={async_comm} kv={kv_heads} tied={tied}"
                for key, value in _check_model(rank, world_size, mode, async_comm, kv_heads, tied).items():
                    diffs[f"{label}: {key}"] = value
    return diffs


@pytest.mark.slow
# kv heads < tp (shared by tp/kv ranks), = tp (one per rank) and > tp (several per rank).
@pytest.mark.parametrize("tp, kv_options", [(2, (1, 2, 4)), (4, (1, 2))])
def test_tensor_parallel_matches_dense_model(tp, kv_options):
    for rank, diffs in enumerate(run_ranks(tp, _model_parity_rank, kv_options)):
        bad = {k: v for k, v in diffs.items() if not v <= TOL}
        assert not bad, f"rank {rank} differs from the dense model: {bad}"


def _shared_gather_rank(rank: int, world_size: int, recompute: bool) -> tuple[int, float]:
    """(all-gathers in one forward, max gradient error) for sequence parallel, with or without
    recomputing each layer in backward."""
    group = dist.group.WORLD
    gathers = 0
    real_gather = comm.all_gather_chunks

    def counting_gather(*args, **kwargs):
        nonlocal gathers
        gathers += 1
        return real_gather(*args, **kwargs)

    comm.all_gather_chunks = counting_gather
    torch.manual_seed(0)
    dense = ToyLM(kv_heads=1, tied=True)
    ids, labels = _data()
    sharded = copy.deepcopy(dense)
    parallelize(sharded, TP_PLAN, group, ReduceScatterMode())
    x = sharded.embed_tokens(ids)
    for layer in sharded.layers:
        x = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
    logits = sharded.lm_head(sharded.norm(x))
    forward_gathers = gathers
    vocab_parallel_cross_entropy(logits, labels, group, sharded.lm_head.vocab_start, TRUE_VOCAB).backward()
    tp_grad_sync(sharded, group)
    ref = dense(ids)
    F.cross_entropy(ref[..., :TRUE_VOCAB].reshape(-1, TRUE_VOCAB), labels.reshape(-1)).backward()
    dense_grads = {name: p.grad for name, p in dense.named_parameters()}
    error = max(
        _grad_diff(name, p.grad, dense_grads, get_placement(p).slices(tuple(p.shape)))
        for name, p in sharded.named_parameters()
    )
    return forward_gathers, error


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, True])
def test_sequence_parallel_gathers_each_block_input_once(recompute):
    # q/k/v share one gather, gate/up another, plus the lm_head's: 2 layers x 2 + 1.
    for gathers, error in run_ranks(2, _shared_gather_rank, recompute):
        assert gathers == 5
        assert error <= TOL


def _collectives_rank(rank: int, world_size: int) -> list[str]:
    group = dist.group.WORLD
    full = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    shard = full.chunk(world_size, dim=1)[rank]
    problems = []
    for fallback in (False, True):  # the second pass takes the path of gloo builds without the fast collectives
        comm._GLOO_UNSUPPORTED.clear()
        if fallback:
            comm._GLOO_UNSUPPORTED.update({"all_gather", "reduce_scatter"})
        if not torch.equal(comm.all_gather_seq(shard, group), full):
            problems.append(f"all_gather_seq fallback={fallback}")
        if not torch.equal(comm.all_gather_seq(shard, group, async_op=True).wait(), full):
            problems.append(f"async all_gather_seq fallback={fallback}")
        scattered = comm.reduce_scatter_seq(full * (rank + 1), group)
        expected = shard * sum(range(1, world_size + 1))
        if not torch.equal(scattered, expected):
            problems.append(f"reduce_scatter_seq fallback={fallback}")
        if not torch.equal(comm.reduce_scatter_seq(full * (rank + 1), group, async_op=True).wait(), expected):
            problems.append(f"async reduce_scatter_seq fallback={fallback}")
    return problems


@pytest.mark.slow
def test_sequence_collectives_on_gloo_with_and_without_fallback():
    assert run_ranks(2, _collectives_rank) == [[], []]


def test_vocab_parallel_cross_entropy_without_group_equals_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, PADDED_VOCAB, requires_grad=True)
    logits_ref = logits.detach()[..., :TRUE_VOCAB].clone().requires_grad_()
    labels = torch.randint(0, TRUE_VOCAB, (2, 5))
    labels[1, 3] = -100
    loss = vocab_parallel_cross_entropy(logits * 1.0, labels, None, 0, TRUE_VOCAB)
    ref = F.cross_entropy(logits_ref.reshape(-1, TRUE_VOCAB), labels.reshape(-1))
    loss.backward()
    ref.backward()
    # Another order of the same float32 ops: a 13-term logsumexp, a 9-token mean, (13 + 9) eps ~ 2.6e-6 at worst.
    # Padding leaking into the logsumexp or an ignored label counted would be off by > 1e-2.
    assert rel_diff(loss.item(), ref.item()) <= 3e-6
    assert rel_diff(logits.grad[..., :TRUE_VOCAB], logits_ref.grad) <= 3e-6
    assert torch.all(logits.grad[..., TRUE_VOCAB:] == 0), "padding columns must get no gradient"


def test_tp_modes_are_registered_and_sequence_parallel_checks_sequence_length():
    plugins = PluginSet()
    plugins.register_object(tp_modes_plugin, "tp_modes")
    registry = plugins.registries.tp_mode
    assert registry.names() == ["ALL_REDUCE", "REDUCE_SCATTER"]
    assert registry.get("REDUCE_SCATTER").factory().sequence_parallel
    assert not registry.get("ALL_REDUCE").factory().sequence_parallel
    check = registry.get("REDUCE_SCATTER").extras["check"]

    def config(tp, seq, cp=1):
        return SimpleNamespace(
            parallelism=SimpleNamespace(tp=tp, context_parallel_size=cp), tokens=SimpleNamespace(sequence_length=seq)
        )

    assert check(config(4, 32), None) == []
    (problem,) = check(config(4, 30), None)
    assert problem.startswith("tokens.sequence_length:") and "divisible by 4" in problem
    # under context parallelism each cp rank's share is what tp splits
    assert check(config(4, 32, cp=2), None) == []
    (problem,) = check(config(4, 36, cp=2), None)  # 18 tokens per cp rank do not split over tp=4
    assert "divisible by cp x tp = 8; got 36" in problem


def test_parallelize_rejects_a_plan_that_names_the_wrong_module_type():
    model = ToyLM(kv_heads=2, tied=False)
    with pytest.raises(Exception, match="needs an nn.Linear, but it is a RMSNorm"):
        parallelize(model, {"norm": "colwise"}, None, AllReduceMode())


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here forever for the dead rank


@pytest.mark.slow
def test_run_ranks_reports_a_failing_rank_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="(?s)rank 1 of 2 failed.*ValueError: rank one is broken"):
        run_ranks(2, _fail_on_rank_1, timeout=60)
    assert time.monotonic() - start < 30
