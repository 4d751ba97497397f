"""The shard stage on preference pairs (train.task dpo): each document is a pair rendered by nightloom/chat_pairs.py,
read back by the trainer's PairRows as [chosen; rejected] rows whose targets are the completions only; bad rows are
FILE:LINE: field, in the shard stage and in the pre-scan that runs before any node is rented; the manifest says
dpo, and SFT's reader refuses it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nightloom.chat import ChatRenderer, ChatSettings
from nightloom.chat_pairs import render_pair, to_pair
from nightloom.sharding import BadInputError, shard_dataset
from nightloom.sharding.prescan import PAIRS, prescan
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from nightloom.train.data import ConversationRows, DataError
from nightloom.train.preference.data import PairRows, heldout_pairs
from nightloom.train.preference.logps import IGNORE_INDEX
from tests.support.chat import CHATML, build_chat_tokenizer, chat_messages


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("pairs") / "tok")


def _records(n: int) -> list[dict]:
    convs = chat_messages(2 * n, seed=9)
    out = []
    for i, c in enumerate(convs[:n]):
        wrong = {"role": "assistant", "content": convs[n + i][-1]["content"] + " wrong"}
        if i % 3 == 0:  # implicit prompt
            out.append({"chosen": c, "rejected": [*c[:-1], wrong]})
        elif i % 3 == 1:
            out.append({"prompt": c[:-1], "chosen": [c[-1]], "rejected": [wrong]})
        else:  # plain text
            out.append(
                {"prompt": c[-2]["content"], "chosen": " " + c[-1]["content"], "rejected": " " + wrong["content"]}
            )
    return out


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _shard(path, out, tokdir, **kw):
    chat = ChatSettings(template=CHATML, seq_len=256, task="dpo")
    sharding = ShardingSpec(output=str(out), **{"num_shards": 2, "tolerance": 0.9, **kw})
    return shard_dataset(DatasetSpec(path=str(path)), sharding, tokenizer=TokenizerSpec(path=str(tokdir)), chat=chat)


def test_pairs_shard_and_read_back_as_chosen_then_rejected_rows(tmp_path, tokdir):
    records = _records(24)
    manifest = _shard(_write(tmp_path / "pairs.jsonl", records), tmp_path / "out", tokdir, heldout=0.1)
    assert manifest.chat.task == "dpo" and '"task": "dpo"' in (tmp_path / "out" / "manifest.json").read_text()
    rows = PairRows(str(tmp_path / "out"), seed=None, tokenizer=TokenizerSpec(path=str(tokdir)))
    assert rows.total + manifest.heldout.rows == len(records)
    r = ChatRenderer(tokdir, CHATML, seq_len=256)
    want = {tuple(render_pair(r, to_pair(rec)).ids) for rec in records}
    batch = rows.batch(0, rows.total)
    n = batch.pairs
    for j, (ids, labels) in enumerate(rows.docs(0, rows.total)):
        assert tuple(int(i) for i in ids) in want
        chosen, rejected = batch.inputs[j], batch.inputs[n + j]
        t_c, t_r = batch.targets[j], batch.targets[n + j]
        c_len = int(np.argmax(np.diff(np.asarray(labels, dtype=int)) == -1)) + 1  # where rejected starts
        assert chosen[: c_len - 1].tolist() == [int(i) for i in ids[: c_len - 1]]
        assert t_c[t_c != IGNORE_INDEX].tolist() == [int(i) for i, lab in zip(ids[:c_len], labels[:c_len]) if lab]
        rej_ids, rej_lab = ids[c_len:], labels[c_len:]
        assert rejected[: len(rej_ids) - 1].tolist() == [int(i) for i in rej_ids[:-1]]
        assert t_r[t_r != IGNORE_INDEX].tolist() == [int(i) for i, lab in zip(rej_ids, rej_lab) if lab]
    assert len(heldout_pairs(str(tmp_path / "out"), TokenizerSpec(path=str(tokdir)))) == manifest.heldout.rows
    with pytest.raises(DataError, match="sharded for train.task dpo"):
        ConversationRows(str(tmp_path / "out"), 256, tokenizer=TokenizerSpec(path=str(tokdir)))


BAD = [
    (
        {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}]},
        "rejected: missing",
    ),
    ({"prompt": "q", "chosen": " a", "rejected": " a"}, "rejected: equals chosen"),
    ({"prompt": "q", "chosen": " ", "rejected": " b"}, "chosen: empty completion"),
    (
        {
            "prompt": [{"role": "robot", "content": "q"}],
            "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}],
        },
        "prompt[0].role: unknown role",
    ),
]


def test_bad_rows_are_file_line_field_in_the_shard_stage_and_the_prescan(tmp_path, tokdir):
    records = _records(6)
    lines = records[:2] + [b for b, _ in BAD] + records[2:]
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(BadInputError) as err:
        _shard(path, tmp_path / "out", tokdir)
    assert f"{path}:3" in str(err.value) and "rejected: missing" in str(err.value)
    found = prescan(DatasetSpec(path=str(path)), ShardingSpec(output=str(tmp_path / "o2")), PAIRS)
    assert found.bad_records == len(BAD)
    for k, (_, message) in enumerate(BAD):
        assert any(f"bad.jsonl:{3 + k}:" in line and message in line for line in found.lines), (message, found.lines)
    manifest = _shard(path, tmp_path / "skip", tokdir, on_error="skip", max_bad_fraction=0.5)
    assert manifest.bad_records == len(BAD) and manifest.rows == len(records)


def test_nightloom_run_refuses_bad_pairs_before_prefect_starts(tmp_path, tokdir):
    """`nightloom run` of a dpo spec whose data holds bad rows stops at the pre-scan: every bad row as
    FILE:LINE: field, exit 1, no run folder and no ledger."""
    import contextlib
    import io

    import yaml

    from flows.cli import main
    from tests.support.chat import QWEN2

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", **QWEN2, "max_position_embeddings": 512}))
    path = _write(tmp_path / "bad.jsonl", _records(4) + [b for b, _ in BAD])
    spec = {
        "name": "bad-pairs",
        "model": {"config": str(config), "tokenizer": {"path": str(tokdir)}},
        "dataset": {"path": str(path)},
        "sharding": {"output": str(tmp_path / "shards"), "num_shards": 2},
        "train": {"task": "dpo", "steps": 2, "seq_len": 128},
        "storage": {"root": str(tmp_path / "runs")},
        "ledger": {"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
    }
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(["run", str(spec_path)])
    out = buf.getvalue()
    assert rc != 0, out
    for k, (_, message) in enumerate(BAD):
        assert f"bad.jsonl:{5 + k}: {message}" in out, out
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ledger.db").exists()
