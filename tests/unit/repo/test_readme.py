"""The README says what a new user sees: the first run's sample output as it prints now, every deployment the UI
registers, commands that run from a fresh shell (`.venv/bin/nightloom`, or after activating), `make ui PORT=`."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_the_first_run_sample_prints_what_a_first_run_prints():
    sample = next(b for b in _blocks("text") if "Starting temporary server" in b)
    gate = next(line for line in sample.splitlines() if "window gate:" in line)
    assert "finish" not in gate.split("no step-time prediction")[0]  # CPU: no finish time is predicted
    assert "no step-time prediction" in gate
    assert "(predicted 30)" not in sample and "(no prediction yet)" in sample
    assert "first use: builds the sample corpus and a tokenizer" in sample and "ledger row: " in sample


def test_every_deployment_the_ui_registers_is_listed():
    names = [d["name"] for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]]
    assert len(names) == 8
    ui = README.split("## The Prefect UI", 1)[1].split("## ", 1)[0]
    assert "eight deployments" in ui
    for name in names:
        assert f"/{name}`" in ui, name


def test_commands_run_from_a_fresh_shell():
    """`nightloom` is on PATH only with the venv active: a bare command only in a block that activates it."""
    for block in _blocks("bash"):
        bare = [line for line in block.splitlines() if line.startswith("nightloom ")]
        assert not bare or "source .venv/bin/activate" in block, bare
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    assert not re.search(r"(?<![/\w])`nightloom (validate|run|plan|cost|queue|ledger)", prose)


def test_make_ui_port_is_documented():
    assert "make ui PORT=4201" in README


def test_the_shard_report_is_said_to_be_on_the_subflow_page():
    """tasks/shard.py creates `shard-report` inside the shard-dataset subflow: it is on that flow run's page."""
    ui = " ".join(README.split("## The Prefect UI", 1)[1].split("## ", 1)[0].split())
    assert "`shard-report` is on the `shard-dataset` subflow's page" in ui
    assert "the `shard-report` and `run-summary` tables" not in ui
