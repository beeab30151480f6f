"""Document masking: in a packed sequence each document is computed as if it were alone.

With `DocumentMasking` set, LLaMA's logits (and so the loss) at every position of a packed batch
equal those of the position's document run on its own from position 0: attention never crosses an
end-of-document token, and rotary positions restart at each document."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanocore.sequence_api import DocumentMasking, document_ids, document_positions
from nanocore_plugins.llama.config import LlamaConfig
from nanocore_plugins.llama.model import LlamaForCausalLM
from tests.helpers.compare import rel_diff

EOS = 1
CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=50,
    max_position_embeddings=64,
)


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**CONFIG))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    return m.eval()


def packed_batch() -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Two rows of 25 tokens (24 inputs + the last label), each packing documents that end with EOS;
    the last document of each row is cut by the window, as in a real packed dataset."""
    g = torch.Generator().manual_seed(3)
    lengths = [[5, 9, 3, 8], [12, 2, 11]]  # with their EOS; the last runs past the window
    rows, docs = [], []
    for row_lengths in lengths:
        row, row_docs = [], []
        for n in row_lengths:
            doc = torch.cat([torch.randint(2, 50, (n - 1,), generator=g), torch.tensor([EOS])])
            row_docs.append(doc)
            row.append(doc)
        rows.append(torch.cat(row)[:25])
        docs.append(row_docs)
    return torch.stack(rows), docs


def test_helpers_find_documents_and_restart_positions():
    ids = torch.tensor([[5, 1, 7, 8, 1, 1, 4]])
    assert document_ids(ids, 1).tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert document_positions(document_ids(ids, 1)).tolist() == [[0, 1, 0, 1, 2, 0, 0]]


def test_packed_loss_equals_each_document_alone():
    m = model()
    batch, _ = packed_batch()
    inputs, labels = batch[:, :-1], batch[:, 1:]
    runtime = DocumentMasking(EOS)
    m.set_sequence_runtime(runtime)
    runtime.set_tokens(inputs)
    with torch.no_grad():
        packed = m(inputs)
    token_loss = F.cross_entropy(packed.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)

    m.set_sequence_runtime(None)
    docs = document_ids(inputs, EOS)
    alone_sum, checked = 0.0, 0
    for b in range(inputs.shape[0]):
        for d in docs[b].unique().tolist():
            where = (docs[b] == d).nonzero().flatten()
            start, end = int(where[0]), int(where[-1]) + 1
            sample = batch[b, start : end + 1]  # the document's tokens and the label after its last one
            with torch.no_grad():
                alone = m(sample[None, :-1])[0]
            assert rel_diff(packed[b, start:end], alone) <= 1e-5, (b, d)
            alone_sum += float(F.cross_entropy(alone, sample[1:], reduction="sum"))
            checked += 1
    assert checked == 7
    assert rel_diff(float(token_loss.mean()), alone_sum / labels.numel()) <= 1e-6

    # and masking matters: without it, later documents see earlier ones
    with torch.no_grad():
        unmasked = m(inputs)
    assert rel_diff(unmasked, packed) > 1e-2
