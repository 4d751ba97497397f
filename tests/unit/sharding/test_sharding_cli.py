"""`nightloom shard`: spec and flag forms, --json summary, exit codes 0 / 1 / 2."""

from __future__ import annotations

import argparse
import json

import pytest

from flows.commands import shard as shard_cmd
from tests.support.sharding import make_docs, write_jsonl


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nightloom")
    shard_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["shard", *argv])
    return args.func(args)


def test_flag_form_json_summary(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(500, seed=1, dup_every=9))
    rc = _cli(
        [
            "--input",
            str(src),
            "--output",
            str(tmp_path / "o"),
            "--shards",
            "3",
            "--tolerance",
            "0.05",
            "--salt",
            "s1",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["balanced"] is True
    assert len(out["shards"]) == 3 and {"index", "rows", "tokens", "bytes"} <= set(out["shards"][0])
    assert out["dedup_dropped"] > 0 and out["imbalance"] <= 0.05
    assert sum(s["rows"] for s in out["shards"]) == out["rows"]
    rc = _cli(
        [
            "--input",
            str(src),
            "--output",
            str(tmp_path / "nd"),
            "--shards",
            "3",
            "--tolerance",
            "0.05",
            "--no-dedup",
            "--balance-by",
            "rows",
            "--json",
        ]
    )
    out2 = json.loads(capsys.readouterr().out)
    assert rc == 0 and out2["dedup_dropped"] == 0 and out2["balance_by"] == "rows"


def test_spec_form_with_override(tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(300))
    spec = tmp_path / "run.yaml"
    spec.write_text(
        "name: t\ndataset: {path: c.jsonl}\nsharding: {num_shards: 2, output: out, tolerance: 0.1,\n"
        "  near_dup: {}, filters: {length: {min_words: 8}}}\n"
    )
    assert _cli([str(spec), "--shards", "3"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "3 shards at" in text and "balanced" in text
    line = next(x for x in text.splitlines() if x.startswith("removed: "))  # the quality line, per filter
    assert "length " in line and "near_dup 0 docs (0 tokens)" in line, line
    samples = line.rsplit("samples in ", 1)[1]
    assert samples.startswith("removed-samples.") and (tmp_path / "out" / samples).is_file()
    assert "[shard] scan 1/1 input files" in captured.err and "[shard] write 3/3 shards" in captured.err
    assert (tmp_path / "out" / "manifest.json").is_file() and src.is_file()


def test_not_balanced_or_failed_is_exit_1(tmp_path, capsys):
    src = tmp_path / "t.jsonl"
    src.write_text('{"text": "%s"}\n{"text": "a"}\n{"text": "b"}\n' % ("x" * 900))
    rc = _cli(["--input", str(src), "--output", str(tmp_path / "o"), "--shards", "2", "--json"])
    cap = capsys.readouterr()
    assert rc == 1
    assert json.loads(cap.out)["balanced"] is False and "need at least" in cap.err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{nope\n')
    assert _cli(["--input", str(bad), "--output", str(tmp_path / "o2"), "--shards", "1"]) == 1
    assert f"{bad}:2: invalid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--input", "x.jsonl", "--shards", "2"], "--output is required"),
        (["--input", "x.jsonl", "--output", "o", "--shards", "0"], "num_shards"),
        (["--input", "x.jsonl", "--output", "o", "--shards", "2", "--tolerance", "1.5"], "tolerance"),
        (["missing-spec.yaml"], "does not exist"),
    ],
)
def test_usage_errors_are_exit_2(argv, needle, capsys):
    assert _cli(argv) == 2
    assert needle in capsys.readouterr().err


def test_argparse_rejects_bad_choice():
    with pytest.raises(SystemExit) as e:
        _cli(["--input", "x", "--output", "o", "--shards", "2", "--balance-by", "lines"])
    assert e.value.code == 2
