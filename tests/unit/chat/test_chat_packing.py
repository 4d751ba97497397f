"""train.pack on real chat shards: packed rows hold every training conversation exactly once per epoch, whole and
with its own labels (the first id of each no label), the same rows on every read (random access by row number)
and on another reader; StepLoader hands each micro-batch its document ids; the spec refuses what cannot pack."""

from __future__ import annotations

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
    root = tmp_path_factory.mktemp("pack")
    tok = build_chat_tokenizer(root / "tok")
    write_chats(root / "chats.jsonl", chat_messages(40, seed=7))
    m = shard_dataset(
        DatasetSpec(path=str(root / "chats.jsonl")),
        ShardingSpec(output=str(root / "out"), num_shards=2, tolerance=0.9),
        tokenizer=TokenizerSpec(path=str(tok)),
        chat=ChatSettings(template=CHATML, seq_len=SEQ),
    )
    return root / "out", TokenizerSpec(path=str(tok)), m


def _rows(shards, **kw):
    from nightloom.train.data import ConversationRows

    out, tok, _ = shards
    return ConversationRows(str(out), SEQ, seed=3, tokenizer=tok, **kw)


def _split(ids, labels, docs):
    """The conversations of one packed row, as (ids, labels) tuples, and the padding's document."""
    convs = []
    for d in range(int(docs.max()) + 1):
        at = np.flatnonzero(docs == d)
        assert (np.diff(at) == 1).all()  # a document is one contiguous run
        convs.append((tuple(ids[at].tolist()), tuple(labels[at].tolist())))
    return convs


def test_packed_rows_hold_every_conversation_once_per_epoch(shards):
    plain, packed = _rows(shards), _rows(shards, pack=True)
    eos = plain.tokenizer.eos_id
    assert packed.total < plain.total / 2  # conversations share rows
    ids, labels = plain.rows(0, plain.total)
    want = []
    for a, b in zip(ids, labels):
        n = len(a) - int(np.argmax((a != eos)[::-1]))  # trailing padding cut (no conversation ends with it here)
        want.append((tuple(a[:n].tolist()), (0, *b[1:n].tolist())))
    got = []
    pids, plabels, pdocs = packed.packed_rows(0, packed.total)
    for a, b, d in zip(pids, plabels, pdocs):
        *convs, pad = _split(a, b, d)
        assert set(pad[0]) == {eos} and not any(pad[1])
        got += convs
    assert sorted(got) == sorted(want)  # each conversation whole, exactly once, its first id no label
    stats = packed.stats()
    assert stats.conversations == plain.total and stats.rows == packed.total and stats.per_row > 2
    # deterministic and random access: another reader, and a read starting mid-epoch, give the same rows
    again = _rows(shards, pack=True).packed_rows(3, 4)
    for a, b in zip(again, (pids[3:7], plabels[3:7], pdocs[3:7])):
        assert np.array_equal(a, b)
    wrapped = packed.packed_rows(packed.total, 2)  # epochs wrap
    assert np.array_equal(wrapped[0], pids[:2])


def test_step_loader_gives_each_micro_batch_its_document_ids(shards):
    from nightloom.train.data import IGNORE_INDEX, StepLoader

    packed = _rows(shards, pack=True)
    batch = StepLoader(packed, micro_batch=2, grad_accum=2, dp=2, dp_rank=1).batch(1)
    assert batch.docs is not None and len(batch.docs) == len(batch.micro) == 2
    ids, labels, docs = packed.packed_rows(1 * 8 + 4, 4)
    x, y = batch.inputs, batch.targets
    assert x.tolist() == ids[:, :-1].tolist() and torch.cat(batch.docs).tolist() == docs[:, :-1].tolist()
    assert ((y != IGNORE_INDEX) == torch.from_numpy(labels[:, 1:].astype(bool))).all()
    assert StepLoader(_rows(shards), 2, 2, 2, 1).batch(1).docs is None  # unpacked: no document ids


def test_the_spec_refuses_pack_without_sft_and_with_pp_or_cp():
    from pydantic import ValidationError

    from nightloom.spec import RunSpec, TrainSpec

    with pytest.raises(ValidationError, match="packing places whole conversations .* it needs train.task: sft"):
        TrainSpec(pack=True)
    base = {"name": "p", "dataset": {"path": "x.jsonl"}, "train": {"task": "sft", "pack": True}}
    for bad in ({"pp": 2}, {"cp": 2}):
        with pytest.raises(ValidationError, match="train.pack: packed sequences need parallel.pp = 1 and"):
            RunSpec(**base, parallel=bad)
    assert RunSpec(**base, parallel={"tp": 2, "sp": True}).train.pack
    # pack False is hash-neutral (old specs keep their hash: tests/unit/spec pins them); pack True is another run
    off = RunSpec(name="p", dataset={"path": "x.jsonl"}, train={"task": "sft"})
    assert off.spec_hash() != RunSpec(**base).spec_hash()
