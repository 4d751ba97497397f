"""One exit-code rule for every `nightloom` command (flows/commands/common.py): 2 for a usage error (a missing file
or folder, a bad or missing option), 1 for a failed run or validation (a spec that does not validate included).
A missing path is named with the current folder, and `eval` checks its paths before it imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import main

ROOT = Path(__file__).resolve().parents[3]


def _spec(tmp_path: Path, **extra) -> str:
    spec = {
        "name": "exit-codes",
        "model": {"name": "tiny"},
        "dataset": {"path": str(tmp_path / "data.jsonl"), "sample": True},
        "cluster": {"provider": {"kind": "local"}, "nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu"},
        "train": {"steps": 10, "seq_len": 128, "global_batch": 4},
        "schedule": {"policy": "split", "price_per_gpu_hour": 1.0},
        "ledger": {"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
    }
    for key, value in extra.items():
        section, field = key.split(".")
        spec[section][field] = value
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    return str(p)


def _commands(spec: str, ledger: str) -> dict[str, list[str]]:
    return {
        "validate": ["validate", spec],
        "run": ["run", spec],
        "plan": ["plan", spec],
        "cost": ["cost", spec, "--hours", "1"],
        "provision": ["provision", spec, "--check"],
        "shard": ["shard", spec],
        "queue": ["queue", "--ledger", ledger, "add", "team", spec, "--hours", "1"],
        "ledger": ["ledger", "--spec", spec, "list"],
    }


@pytest.mark.parametrize("command", ["validate", "run", "plan", "cost", "provision", "shard", "queue", "ledger"])
def test_a_missing_spec_is_a_usage_error_naming_the_current_folder(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = _commands("nope.yaml", f"sqlite:///{tmp_path / 'ledger.db'}")[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "spec file 'nope.yaml' does not exist" in err and f"current folder {tmp_path}" in err, err
    assert str(tmp_path / "nope.yaml") in err


@pytest.mark.parametrize("command", ["validate", "plan", "cost", "provision", "shard", "queue", "ledger"])
def test_a_spec_that_does_not_validate_exits_1_everywhere(command, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    if command == "queue":
        assert main(["queue", "--ledger", url, "create", "team", "--max-nodes", "4"]) == 0
    bad = _spec(tmp_path, **{"train.stepz": 3})
    assert main(_commands(bad, url)[command]) == 1
    assert "train.stepz: unknown key (typo?)" in capsys.readouterr().err


def test_give_hours_is_the_same_usage_error_in_cost_and_queue(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    spec = _spec(tmp_path)  # gpu_type cpu: the planner predicts no step time, the ledger has none
    assert main(["cost", spec]) == 2
    from_cost = capsys.readouterr().err
    assert main(["queue", "--ledger", url, "create", "team", "--max-nodes", "4"]) == 0
    assert main(["queue", "--ledger", url, "add", "team", spec]) == 2
    from_queue = capsys.readouterr().err
    for err in (from_cost, from_queue):
        assert "no step time for exit-codes" in err and "give --hours" in err, err
    assert main(["queue", "--ledger", url, "add", "team", spec, "--hours", "1"]) == 0


@pytest.mark.slow
def test_eval_checks_its_paths_before_importing_torch(tmp_path):
    """`nightloom eval /no/such/dir` said "no job*.json" after importing torch (7-9 s on a loaded machine)."""
    code = "import sys; from flows.cli import main\nrc = main(sys.argv[1:]); print(rc, 'torch' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", code, "eval", str(tmp_path / "nope"), "--data", "x.jsonl"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr)
    assert f"nightloom eval: error: run folder '{tmp_path / 'nope'}' does not exist" in r.stderr
    assert f"current folder {tmp_path}" in r.stderr


def test_eval_names_what_is_wrong_with_its_paths(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.json").write_text("{}")
    for folder, needle in (
        (tmp_path, f"{tmp_path}: no job*.json: not a nightloom run folder"),
        (run_dir, "--data file 'x.jsonl' does not exist"),
    ):
        assert main(["eval", str(folder), "--data", "x.jsonl"]) == 2
        assert f"nightloom eval: error: {needle}" in capsys.readouterr().err


def test_export_on_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), "--output", str(tmp_path / "out")]) == 2
    assert "run folder" in (err := capsys.readouterr().err) and "does not exist" in err
