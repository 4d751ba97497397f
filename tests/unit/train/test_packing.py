"""train.pack: a packed row of conversations computes what the conversations compute one by one (block-causal
attention, positions restarting per document, sliding windows too), and the packer is deterministic, keeps every
conversation whole and places each exactly once per epoch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from nightloom.catalog import get_model
from nightloom.train.model import build_model
from nightloom.train.packing import PackStats, fill_row, first_fit

LLAMA = replace(get_model("tiny"), kv_heads=2)  # GQA
#: Gemma 3's layout: sliding layers (window 5, shorter than every conversation here) with their own RoPE base,
#: (1 + w) norms, post-norms, scaled embeddings, GeGLU, q/k norms, soft-capped logits
GEMMA = replace(
    get_model("tiny"),
    layers=3,
    sliding_window=5,
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    rope_local_theta=10_000.0,
    rope_theta=1_000_000.0,
    norm_offset=1.0,
    post_norms=True,
    embed_scale=True,
    mlp_act="gelu_tanh",
    qk_norm=True,
    query_pre_attn_scalar=16.0,
    final_logit_softcap=30.0,
)
MISTRAL = replace(get_model("tiny"), sliding_window=4)  # every layer sliding


def _model(shape, seq_len=48):
    torch.manual_seed(0)
    m = build_model(shape, seq_len, device="cpu")
    m.init_weights(11)
    with torch.no_grad():  # norms away from their init value, so a wrong offset would show
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    return m.eval()


@pytest.mark.parametrize("shape", [LLAMA, GEMMA, MISTRAL], ids=["llama", "gemma3_sliding", "mistral_sliding"])
def test_packed_forward_equals_the_conversations_one_by_one(shape):
    model = _model(shape)
    g = torch.Generator().manual_seed(1)
    lengths = [13, 7, 19]
    convs = [torch.randint(0, shape.vocab, (n,), generator=g) for n in lengths]
    window = 48
    ids, _, docs = fill_row([(c.numpy(), np.ones(len(c), np.uint8)) for c in convs], window, pad=3)
    x, d = torch.from_numpy(ids)[None], torch.from_numpy(docs)[None]
    with torch.no_grad():
        packed = model(x, doc_ids=d)[0]
        plain = model(x)[0]
        at = 0
        for c in convs:
            alone = model(c[None])[0]
            torch.testing.assert_close(packed[at : at + len(c)], alone, rtol=0, atol=1e-5)
            at += len(c)
        # the first conversation needs no mask; every later one differs from plain causal attention over the row
        assert (plain[lengths[0] :] - packed[lengths[0] :]).abs().max() > 1e-3
    # the padding is a document of its own: what it computes is the pad ids alone
    torch.testing.assert_close(packed[at:], model(x[:, at:])[0], rtol=0, atol=1e-5)


def test_positions_restart_at_each_document():
    """RoPE sees each id's position in its own document (scores depend on the offset alone, so logits could not
    tell an unrestarted position at fp32; the positions themselves can)."""
    from nightloom.train.model import DocumentMask

    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 1, 1]])
    dm = DocumentMask(docs)
    assert dm.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 1]]
    m = dm.mask(2)[:, 0]
    assert m[0, 4].tolist() == [False, False, False, True, True, False, False, False, False]
    assert m[1, 6].tolist() == [False] * 5 + [True, True, False, False]  # the window: itself and one before


def test_packed_gradients_equal_the_sum_of_the_conversations():
    model = _model(LLAMA)
    g = torch.Generator().manual_seed(2)
    convs = [torch.randint(0, 256, (n,), generator=g) for n in (9, 14, 6)]
    ids, _, docs = fill_row([(c.numpy(), np.ones(len(c), np.uint8)) for c in convs], 32, pad=0)
    model(torch.from_numpy(ids)[None], doc_ids=torch.from_numpy(docs)[None])[0, :29].float().pow(2).sum().backward()
    packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for c in convs:
        model(c[None])[0].float().pow(2).sum().backward()
    for a, b in zip(packed, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_fill_row_marks_documents_and_drops_the_label_across_a_boundary():
    ids, labels, docs = fill_row(
        [(np.array([5, 6, 7]), np.array([1, 1, 1], np.uint8)), (np.array([8, 9]), np.array([1, 0], np.uint8))], 8, 0
    )
    assert ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert docs.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert labels.tolist() == [0, 1, 1, 0, 0, 0, 0, 0]  # each conversation's first id is no label


def _brute_first_fit(lengths, order, window):
    rows: list[list[int]] = []
    room: list[int] = []
    for c in order:
        r = next((i for i, free in enumerate(room) if free >= lengths[c]), None)
        if r is None:
            rows.append([])
            room.append(window)
            r = len(rows) - 1
        rows[r].append(c)
        room[r] -= lengths[c]
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_fit_places_every_conversation_once_whole_and_deterministically(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 65, size=300)
    order = rng.permutation(300)
    plan = first_fit(lengths, order, 64)
    again = first_fit(lengths.copy(), order.copy(), 64)
    assert np.array_equal(plan.members, again.members) and np.array_equal(plan.starts, again.starts)
    assert sorted(plan.members.tolist()) == list(range(300))  # each once per epoch
    rows = [plan.row(r).tolist() for r in range(plan.rows)]
    assert all(sum(lengths[c] for c in row) <= 64 for row in rows)  # never more than a row: none split
    assert rows == _brute_first_fit(lengths, order, 64)  # greedy first-fit in the seeded order
    assert plan.ids == int(lengths.sum())
    stats = PackStats(300, plan.rows, plan.ids, 64)
    assert stats.per_row > 1.5 and stats.fill > 0.8, stats.line()


def test_first_fit_refuses_a_conversation_longer_than_a_row():
    with pytest.raises(ValueError, match="conversation 1 has 9 ids, more than a row of seq_len\\+1 = 8"):
        first_fit(np.array([3, 9]), None, 8)
