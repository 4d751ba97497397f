"""Unpacked SFT micro-batches (train/sft_batch.py) on real chat shards: each is as wide as its longest row, not
seq_len, with the same loss as the seq_len-wide batch; train.group_by_length groups a step's rows (the same rows)
deterministically and balanced over DP ranks; layouts whose ranks share one shape keep seq_len; a step reports its
label tokens, computed ids and FLOPs, and the MFU gate reads those FLOPs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nightloom.chat import ChatSettings
from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from tests.support.chat import CHATML, build_chat_tokenizer, chat_messages, write_chats

SEQ = 256


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    tok = build_chat_tokenizer(root / "tok")
    write_chats(root / "chats.jsonl", chat_messages(24, seed=11, long_every=5))
    shard_dataset(
        DatasetSpec(path=str(root / "chats.jsonl")),
        ShardingSpec(output=str(root / "out"), num_shards=2, tolerance=0.9),
        tokenizer=TokenizerSpec(path=str(tok)),
        chat=ChatSettings(template=CHATML, seq_len=SEQ),
    )
    return root / "out", TokenizerSpec(path=str(tok))


def _rows(shards):
    from nightloom.train.data import ConversationRows

    out, tok = shards
    return ConversationRows(str(out), SEQ, seed=3, tokenizer=tok)


def _loader(rows, mb=2, ga=2, dp=1, r=0, **kw):
    from nightloom.train.data import StepLoader

    return StepLoader(rows, micro_batch=mb, grad_accum=ga, dp=dp, dp_rank=r, **kw)


def test_an_unpacked_micro_batch_is_padded_to_its_longest_row_not_seq_len(shards):
    rows = _rows(shards)
    batch = _loader(rows).batch(1)
    full_x, full_y = rows.sequences(4, 4)  # step 1's rows, padded to seq_len as before
    lengths = rows.lengths(4, 4)
    for i, (x, y) in enumerate(batch.micro):
        longest = int(lengths[2 * i : 2 * i + 2].max())
        assert x.shape == y.shape == (2, longest - 1) and longest - 1 < SEQ
        assert torch.equal(x, full_x[2 * i : 2 * i + 2, : longest - 1])
        assert torch.equal(y, full_y[2 * i : 2 * i + 2, : longest - 1])
        assert (full_y[2 * i : 2 * i + 2, longest - 1 :] == -100).all()  # nothing cut was a label
    ids, _, got = rows.rows_at(np.arange(4, 8))
    assert got.tolist() == lengths.tolist() and (ids[np.arange(4), got - 1] >= 0).all()


def test_the_loss_is_the_seq_len_padded_batchs(shards):
    from nightloom.catalog import get_model
    from nightloom.train.model import build_model
    from nightloom.train.parallelize import label_nll_sum

    rows = _rows(shards)
    model = build_model(dataclasses.replace(get_model("tiny"), vocab=320), SEQ, device="cpu")
    model.init_weights(7)
    full_x, full_y = rows.sequences(0, 4)
    with torch.no_grad():
        want = label_nll_sum(model(full_x), full_y)
        got = sum(label_nll_sum(model(x), y) for x, y in _loader(rows).batch(0).micro)
    cut = _loader(rows).batch(0).micro
    assert sum(int((y != -100).sum()) for _, y in cut) == int((full_y != -100).sum())  # the same label tokens
    assert max(x.shape[1] for x, _ in cut) < SEQ
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_widths_follow_the_layout():
    from nightloom.train.sft_batch import batch_width, micro_batches, width_multiple

    assert width_multiple(1, 1, 1, False, "cpu") == 1 and width_multiple(1, 1, 2, False, "cuda") == 8
    assert width_multiple(2, 1, 1, False, "cpu") is None and width_multiple(1, 2, 1, False, "cpu") is None
    assert width_multiple(1, 1, 4, True, "cpu") == 4 and width_multiple(1, 1, 4, True, "cuda") == 8
    assert width_multiple(1, 1, 3, True, "cuda") == 24  # SP: the sequence splits over tp ranks
    assert batch_width(np.array([10, 31]), 64, 1) == 30 and batch_width(np.array([10, 31]), 64, 8) == 32
    assert batch_width(np.array([65]), 64, 8) == 64 and batch_width(np.array([10]), 64, None) == 64
    x = torch.arange(4 * 64).reshape(4, 64)
    assert [m[0].shape[1] for m in micro_batches(x, x, np.array([5, 9, 65, 3]), 2, 4)] == [8, 64]


def test_group_by_length_keeps_the_steps_rows_and_is_deterministic_and_balanced(shards):
    from nightloom.train.sft_batch import length_order

    rows = _rows(shards)
    dp, mb, ga = 2, 2, 2
    plain = [_loader(rows, mb, ga, dp, r).batch(2) for r in range(dp)]
    grouped = [_loader(rows, mb, ga, dp, r, group_by_length=True).batch(2) for r in range(dp)]
    again = [_loader(_rows(shards), mb, ga, dp, r, group_by_length=True).batch(2) for r in range(dp)]

    def row_set(parts):
        return sorted(
            tuple(x[j].tolist()[:5]) + (int((y[j] != -100).sum()),)
            for p in parts
            for x, y in p.micro
            for j in range(len(x))
        )

    assert row_set(grouped) == row_set(plain)  # the same conversations in step 2, only arranged otherwise
    for a, b in zip(grouped, again):
        assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a.micro, b.micro))
    width = lambda parts: sum(x.shape[1] for p in parts for x, _ in p.micro)  # noqa: E731
    assert width(grouped) <= width(plain)  # similar rows share a micro-batch: less padding
    order = length_order(np.array([5, 1, 8, 3, 7, 2, 6, 4]), 1, 2)
    assert sorted(order.tolist()) == list(range(8))
    ranks = np.array([5, 1, 8, 3, 7, 2, 6, 4])[order].reshape(2, 4)  # snake: 1,4,5,8 | 2,3,6,7
    assert ranks.tolist() == [[1, 4, 5, 8], [2, 3, 6, 7]] and abs(int(ranks[0].sum()) - int(ranks[1].sum())) <= 2


def test_a_step_reports_label_tokens_computed_ids_and_their_flops(shards, monkeypatch):
    import torch.distributed as dist

    from nightloom.catalog import get_model
    from nightloom.gates import MfuInputs, measure_mfu
    from nightloom.metrics import StepMetrics
    from nightloom.perf import Peak, flops_per_token
    from nightloom.train.sft_batch import FlopCounter, label_scale, step_counts

    rows, shape = _rows(shards), get_model("tiny")
    micro = _loader(rows).batch(0).micro
    flops = FlopCounter(shape, "none", frozen_base=False)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        c = step_counts(micro, flops, True, 1, 1, torch.device("cpu"))
    finally:
        if started:
            dist.destroy_process_group()
    labels = sum(int((y != -100).sum()) for _, y in micro)
    assert c.labels == labels and c.computed == sum(x.numel() for x, _ in micro) < 4 * SEQ
    assert c.flops == pytest.approx(sum(x.numel() * flops_per_token(shape, x.shape[1]) for x, _ in micro))
    assert label_scale(c, 0, 1, 1, len(micro)) == pytest.approx(len(micro) / labels)
    pre = step_counts([(torch.zeros(2, 8, dtype=torch.long),) * 2], flops, False, 4, 1, None)
    assert pre.labels == pre.computed == 64 and pre.flops == pytest.approx(64 * flops_per_token(shape, 8))
    # the MFU gate divides the FLOPs the step computed, not seq_len's, by the time
    step = StepMetrics(
        step=2, loss=1.0, tokens=c.computed, tokens_per_s=c.computed, flops=c.flops, hardware_flops=c.hflops
    )
    step.label_tokens, step.label_tokens_per_s = c.labels, float(c.labels)
    inputs = MfuInputs(flops_per_token(shape, SEQ), flops_per_token(shape, SEQ), 1, Peak(1e12, "fp32", "measured"))
    report = measure_mfu([step, step], inputs, warmup=0)
    assert report.mfu == pytest.approx(c.flops / 1e12)


def test_group_by_length_needs_unpacked_sft(tmp_path):
    from nightloom.spec.checks import semantic_errors

    def errs(**train):
        return [e for e in semantic_errors({"train": train}, tmp_path) if e[0] == ("train", "group_by_length")]

    assert errs(task="sft", group_by_length=True) == []
    assert errs(task="sft", pack=True, group_by_length=True) and errs(group_by_length=True)


def test_the_step_line_names_label_tokens_only_where_they_differ():
    """Pretraining labels every id: '(labels N)' would repeat tok/s; unpacked SFT computes padding too."""
    from nightloom.train.sft_batch import labels_note

    assert labels_note(12_222.4, 12_222.4) == ""
    assert labels_note(11_428.0, 4_086.0) == " (labels 4,086)"
