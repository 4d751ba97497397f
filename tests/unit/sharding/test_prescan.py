"""The pre-scan (nightloom/sharding/prescan.py): `nightloom run` reports a local dataset's bad records once, with
the fix, before Prefect starts; bounded in bytes and time; the shard stage's own error names the fix too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from nightloom.sharding.errors import BadInputError
from nightloom.spec import DatasetSpec, ShardingSpec

ROOT = Path(__file__).resolve().parents[3]
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
WIZARD = {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _chat_spec(tmp_path: Path, chats: Path) -> Path:
    """The chat demo's spec with its data file `chats` and every output under tmp_path (nothing built yet)."""
    data = yaml.safe_load((ROOT / "deployments" / "chat-sft-demo.yaml").read_text())
    data["dataset"] = {"path": str(chats)}
    data["model"]["weights"] = str(tmp_path / "model")
    data["model"]["config"] = str(ROOT / "deployments" / data["model"]["config"])
    data["model"]["tokenizer"]["path"] = str(tmp_path / "tokenizer")
    data["sharding"]["output"] = str(tmp_path / "shards")
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def test_run_reports_an_unknown_role_once_with_the_fix_before_prefect(tmp_path, monkeypatch, capsys):
    """`nightloom run` on chats with one unknown role: exit 1, `FILE:LINE: field: reason` printed once, the count
    and `sharding.on_error: skip`; the flow module is never imported (so no Prefect server can start)."""
    from flows.cli import main

    chats = _jsonl(tmp_path / "chats.jsonl", [GOOD, GOOD, WIZARD, GOOD])
    monkeypatch.setitem(sys.modules, "flows.pipeline", None)  # importing the flow raises ImportError
    assert main(["run", str(_chat_spec(tmp_path, chats))]) == 1
    out, err = capsys.readouterr()
    lines = (out + err).splitlines()
    assert f"{chats}:3: messages[0].role: unknown role 'wizard' (expected system, user, assistant)" in lines
    assert (out + err).count("unknown role") == 1 and "Traceback" not in out + err
    assert any(ln.startswith("1 bad record in 4 records read") for ln in lines), lines
    assert "`sharding.on_error: skip` to drop bad records and count them" in err
    assert not (tmp_path / "tokenizer").exists()  # nothing was built or run


def test_record_path_errors_are_listed_one_a_line_then_counted(tmp_path):
    from nightloom.sharding.prescan import SHOWN, prescan

    bad = ["{not json"] * (SHOWN + 3)
    path = _jsonl(tmp_path / "corpus.jsonl", [{"text": "ok"}, {"body": "no text"}, *bad])
    found = prescan(DatasetSpec(path=str(path)), ShardingSpec(output=str(tmp_path / "out")))
    assert not found.ok and found.complete and found.records == SHOWN + 5 and found.bad_records == SHOWN + 4
    lines = found.report().splitlines()
    assert lines[0] == f"{path}:2: missing field 'text'"
    assert lines[1].startswith(f"{path}:3: invalid JSON")
    assert lines[SHOWN] == "... and 4 more bad records"
    assert "Fix the records, or set `sharding.on_error: skip`" in lines[-1]


def test_bounded_by_bytes_and_time(tmp_path):
    from nightloom.sharding.prescan import prescan

    path = _jsonl(tmp_path / "chats.jsonl", [GOOD] * 2000 + [WIZARD])
    ds, sh = DatasetSpec(path=str(path)), ShardingSpec(output=str(tmp_path / "out"))
    by_bytes = prescan(ds, sh, chat_style="auto", max_bytes=10_000)
    assert by_bytes.ok and not by_bytes.complete and 0 < by_bytes.records < 2000
    by_time = prescan(ds, sh, chat_style="auto", max_s=0.0)
    assert by_time.ok and not by_time.complete and by_time.records < 2000
    whole = prescan(ds, sh, chat_style="auto")
    assert (
        whole.complete
        and whole.bad_records == 1
        and whole.lines == [f"{path}:2001: messages[0].role: unknown role 'wizard' (expected system, user, assistant)"]
    )


def test_nothing_to_prescan_and_unreadable_input(tmp_path):
    from nightloom.sharding.prescan import prescan

    out = str(tmp_path / "out")
    assert prescan(DatasetSpec(path=str(tmp_path / "x.jsonl")), ShardingSpec(output=out, on_error="skip")) is None
    assert prescan(DatasetSpec(path="s3://bucket/data/"), ShardingSpec(output=out)) is None
    assert prescan(DatasetSpec(path=str(tmp_path / "s.jsonl"), sample=True), ShardingSpec(output=out)) is None
    missing = prescan(DatasetSpec(path=str(tmp_path / "nope.jsonl")), ShardingSpec(output=out))
    assert missing.unreadable == 1 and missing.lines == [f"{tmp_path / 'nope.jsonl'}: dataset path not found"]
    assert "on_error" not in missing.report().splitlines()[-1]  # skipping records cannot help a missing file


def test_the_shard_stage_error_names_the_fix_too(tmp_path):
    from nightloom.sharding import shard_dataset

    path = _jsonl(tmp_path / "corpus.jsonl", [{"text": "a"}, {"text": 3}, {"text": "b"}])
    with pytest.raises(BadInputError) as e:
        shard_dataset(DatasetSpec(path=str(path)), ShardingSpec(output=str(tmp_path / "out"), num_shards=1))
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: int in field 'text'; fix the record, or set `sharding.on_error: skip`"), msg
    assert "\n" not in msg
