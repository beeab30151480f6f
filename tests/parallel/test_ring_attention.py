"""Context-parallel attention equals one-process causal attention: outputs and gradients of q, k and v,
float32, with grouped-query heads and with document masking, at cp 2 and 4, in both modes (the ring,
and all-to-all: heads split over the ranks, the whole sequence on each); and with a sliding window and
attention sinks (their gradient too), the ring skipping the blocks wholly outside the window."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanocore.model_parts.attention import attention
from nanocore.sequence_api import document_attention, document_ids, repeat_kv
from nanocore_plugins.parallel.context_parallel import ContextParallel, zigzag_index
from tests.helpers.compare import rel_diff
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.slow

B, HEADS, KV_HEADS, S, D = 2, 4, 2, 32, 8
SEPARATOR = 9


def inputs(docs: bool | str, kv_heads: int = KV_HEADS, dv: int = D):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, S, D, generator=g)
    k = torch.randn(B, kv_heads, S, D, generator=g)
    v = torch.randn(B, kv_heads, S, dv, generator=g)
    dout = torch.randn(B, HEADS, S, dv, generator=g)
    ids = torch.randint(0, 8, (B, S), generator=g)
    if docs == "chunks":  # one document per chunk of 4 tokens (cp 4): every off-diagonal ring block is masked
        ids[:, 3::4] = SEPARATOR
    elif docs == "first_in_chunks":
        ids[0, 3::4] = SEPARATOR
    elif docs:  # documents of different lengths, one of them crossing every chunk boundary
        ids[0, [3, 4, 20]] = SEPARATOR
        ids[1, [14, 30]] = SEPARATOR
    return q, k, v, dout, ids


def reference(docs: bool | str, kv_heads: int = KV_HEADS, dv: int = D):
    q, k, v, dout, ids = inputs(docs, kv_heads, dv)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if docs:
        out = document_attention(q, k, v, document_ids(ids, SEPARATOR))
    else:
        kr, vr = repeat_kv(q, k, v)
        out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


SINKS = torch.randn(HEADS, generator=torch.Generator().manual_seed(5)) * 2


def windowed_reference(docs: bool, window: int | None, with_sinks: bool):
    q, k, v, dout, ids = inputs(docs)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sinks = SINKS.clone().requires_grad_() if with_sinks else None
    if docs:
        out = document_attention(q, k, v, document_ids(ids, SEPARATOR), window, sinks)
    else:
        out = attention(q, k, v, window, sinks)
    out.backward(dout)
    return out.detach(), [q.grad, k.grad, v.grad], sinks.grad if with_sinks else None


def _ring(rank, world_size, docs, tile=None, mode="ring", kv_heads=KV_HEADS, dv=D, window=None, with_sinks=False):
    if tile is not None:  # scores a few query rows at a time
        from nanocore_plugins.parallel import context_parallel

        context_parallel._TILE_ELEMENTS = tile
    q, k, v, dout, ids = inputs(docs, kv_heads, dv)
    ranks = list(range(world_size))
    runtime = ContextParallel(dist.group.WORLD, world_size, rank, ranks, SEPARATOR if docs else None, mode)
    runtime.layout = runtime.prepare(ids)
    local = [runtime.shard(t.transpose(1, 2)).transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    sinks = SINKS.clone().requires_grad_() if with_sinks else None
    out = runtime.attend(*local, window=window, sinks=sinks) if window or with_sinks else runtime.attend(*local)
    out.backward(runtime.shard(dout.transpose(1, 2)).transpose(1, 2))
    return {
        "out": out.detach(),
        "grads": [t.grad for t in local],
        "sinks_grad": sinks.grad if with_sinks else None,
        "index": zigzag_index(S, world_size, rank),
        "blocks": (runtime.blocks_computed, runtime.blocks_skipped),
        "bytes_sent": runtime.bytes_sent,
    }


def assert_matches_reference(out, grads, ref) -> None:
    """Output and q, k, v gradients within 1e-5 (relative) of the one-process ones."""
    ref_out, *ref_grads = ref
    assert rel_diff(out, ref_out) <= 1e-5
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert rel_diff(got, want) <= 1e-5, name


def _assemble(results, index_key="index", kv_heads=KV_HEADS, dv=D):
    out = torch.zeros(B, HEADS, S, dv)
    grads = [torch.zeros(B, HEADS, S, D), torch.zeros(B, kv_heads, S, D), torch.zeros(B, kv_heads, S, dv)]
    for r in results:
        out[:, :, r[index_key]] = r["out"]
        for full, part in zip(grads, r["grads"], strict=True):
            full[:, :, r[index_key]] = part
    return out, grads


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_context_parallel_attention_equals_one_process(cp, docs, mode):
    out, grads = _assemble(run_ranks(cp, _ring, docs, None, mode))
    assert_matches_reference(out, grads, reference(docs))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_all_to_all_repeats_key_value_heads_fewer_than_cp(kv_heads):
    """cp 4 over 4 query heads and 1 or 2 key/value heads (each repeated to one per rank), with a value
    width unlike the query/key width (multi-head latent attention's), under document masking."""
    out, grads = _assemble(run_ranks(4, _ring, True, None, "all_to_all", kv_heads, 6), kv_heads=kv_heads, dv=6)
    assert_matches_reference(out, grads, reference(True, kv_heads, 6))


def test_ring_attention_skips_blocks_the_document_mask_removes():
    """Documents that never cross a chunk leave only the diagonal block of each rank to compute: the
    other 3 of 4 blocks of each of the 2 samples are skipped, in forward and backward, and the result is
    unchanged (counts are per sample and block)."""
    results = run_ranks(4, _ring, "chunks")
    assert [r["blocks"] for r in results] == [(2, 6)] * 4
    out, grads = _assemble(results)
    assert_matches_reference(out, grads, reference("chunks"))
    # one sample in chunk-sized documents, the other one document: blocks skipped for the first only
    results = run_ranks(4, _ring, "first_in_chunks")
    assert [r["blocks"] for r in results] == [(5, 3)] * 4
    out, grads = _assemble(results)
    assert_matches_reference(out, grads, reference("first_in_chunks"))


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_sent_are_what_docs_context_parallel_says(cp):
    """Per rank, forward and backward of one attention (float32, L = S/cp local tokens): the ring sends
    its stacked k, v cp-1 times in each direction of the pass plus the k, v gradient accumulators cp
    times; all-to-all sends q, k, v and the output, (cp-1)/cp of each, in forward and again in backward."""
    length, word = S // cp, 4
    kv = 2 * B * KV_HEADS * length * D * word
    ring = run_ranks(cp, _ring, False)
    assert {r["bytes_sent"] for r in ring} == {(2 * (cp - 1) + cp) * kv}
    kv_heads = max(KV_HEADS, cp)  # repeated to one per rank at cp 4
    a2a = run_ranks(cp, _ring, False, None, "all_to_all")
    per_pass = (2 * HEADS + 2 * kv_heads) * B * length * D * word * (cp - 1) // cp
    assert {r["bytes_sent"] for r in a2a} == {2 * per_pass}


def test_ring_attention_in_row_tiles_equals_one_process():
    """Long sequences score a tile of query rows at a time; tiles of 2 rows give the same result."""
    out, grads = _assemble(run_ranks(2, _ring, True, 2 * B * KV_HEADS * S))
    assert_matches_reference(out, grads, reference(True))


def test_zigzag_chunks_cover_the_sequence_once_and_balance_causal_work():
    cp = 4
    held = [zigzag_index(S, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(S))
    # causal work of a rank: sum over its queries of the keys they see (position + 1)
    work = [int((index + 1).sum()) for index in held]
    assert len(set(work)) == 1, work
    assert held[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(("docs", "window", "with_sinks"), [(False, 6, False), (True, 6, True), (False, None, True)])
def test_windows_and_sinks_under_context_parallelism_equal_one_process(cp, docs, window, with_sinks, mode):
    """The sinks' gradient is summed over the ranks (each holds some queries, or some heads)."""
    results = run_ranks(cp, _ring, docs, None, mode, KV_HEADS, D, window, with_sinks)
    out, grads = _assemble(results)
    ref_out, ref_grads, ref_sinks = windowed_reference(docs, window, with_sinks)
    assert_matches_reference(out, grads, (ref_out, *ref_grads))
    if with_sinks:
        assert rel_diff(sum(r["sinks_grad"] for r in results), ref_sinks) <= 1e-5


def test_the_ring_skips_every_block_wholly_outside_the_window():
    """cp 4, 32 tokens in 8 chunks of 4, a window of 4: a query sees at most the chunk before its own,
    so of each rank's 4 blocks per sample only those holding a neighbouring chunk are computed."""
    results = run_ranks(4, _ring, False, None, "ring", KV_HEADS, D, 4, False)
    # rank r holds chunks r and 7 - r; a block is live if it holds chunk c or c - 1 of a query chunk c
    live = []
    for r in range(4):
        mine = {r, 7 - r}
        count = sum(any(q - c in (0, 1) for q in mine for c in {j, 7 - j}) for j in range(4))
        live.append((B * count, B * (4 - count)))
    assert [r["blocks"] for r in results] == live
    assert sum(s for _, s in live) > 0
    out, grads = _assemble(results)
    ref_out, ref_grads, _ = windowed_reference(False, 4, False)
    assert_matches_reference(out, grads, (ref_out, *ref_grads))
