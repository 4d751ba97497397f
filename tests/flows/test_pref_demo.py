"""The README's preference-tuning demo (deployments/pref-demo.yaml), run as shipped through `nightloom run` but
with its build folders under tmp: pairs are built from the chat demo's conversations (the answer's words reversed
as rejected), LoRA DPO trains under FSDP2 on 2 ranks against the base with its adapters disabled, and the held-out
pairs go from reward accuracy 0 and DPO loss ln 2 (policy = reference) to accuracy >= 0.7 and a loss below ln 2;
every gate passes (reward_accuracy among them), metrics.jsonl carries TRL's names, the ledger's row is task dpo
with the held-out figures, `nightloom eval RUN --data pairs.jsonl --json` scores pairs against the reference, and
the export holds the merged model and the PEFT adapter."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "deployments" / "pref-demo.yaml"
TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")


def _cli(args: list[str]) -> tuple[int, str]:
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(args)
    return rc, buf.getvalue()


@pytest.mark.slow
def test_pref_demo_runs_as_shipped(prefect_backend, tmp_path):
    from nightloom.ledger import Ledger

    data = yaml.safe_load(DEMO.read_text())
    data["model"]["weights"] = str(tmp_path / "models" / "qwen2")
    data["model"]["config"] = str(DEMO.parent / data["model"]["config"])
    data["model"]["tokenizer"]["path"] = str(tmp_path / "tokenizer")
    data["dataset"]["path"] = str(tmp_path / "pairs.jsonl")
    data["sharding"]["output"] = str(tmp_path / "shards")
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    data["validate"]["benchmarks"]["include_path"] = str(tmp_path / "bench-tasks")
    spec = tmp_path / "pref-demo.yaml"
    spec.write_text(yaml.safe_dump(data))

    rc, out = _cli(["run", str(spec), "--json"])
    assert rc == 0, out[-5000:]
    summary = json.loads(out[out.index("{\n") :])
    assert summary["status"] == "completed" and summary["steps"] == data["train"]["steps"], summary
    first = json.loads((tmp_path / "pairs.jsonl").read_text().splitlines()[0])
    assert first["chosen"][0]["role"] == "assistant" and first["rejected"] != first["chosen"]  # pairs, built here
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["chat"]["task"] == "dpo"

    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    start, last = rows[0], rows[-1]
    assert start["start_eval_rewards/accuracies"] == 0.0 and start["start_eval_loss"] == pytest.approx(math.log(2))
    assert last["eval_rewards/accuracies"] >= 0.7 and last["eval_loss"] < math.log(2), last
    assert all(name in row for row in rows for name in TRL_NAMES)
    gates = {v["name"]: v for v in summary["verdicts"]}
    assert gates["reward_accuracy"]["passed"] and gates["reward_accuracy"]["measured"] >= 0.7

    ledger = Ledger(data["ledger"]["url"])
    try:
        row = ledger.get(summary["run_id"])
    finally:
        ledger.close()
    figures = {f.name: f for f in row.figures}
    assert row.task == "dpo" and figures["eval_rewards/accuracies"].base == 0.0
    assert figures["eval_rewards/accuracies"].value == last["eval_rewards/accuracies"]
    assert figures["eval_loss"].value < figures["eval_loss"].base
    _benchmarks_recorded(summary, figures, tmp_path)

    pairs = tmp_path / "some-pairs.jsonl"
    pairs.write_text("\n".join((tmp_path / "pairs.jsonl").read_text().splitlines()[:16]) + "\n")
    rc, out = _cli(["eval", summary["run_dir"], "--data", str(pairs), "--json"])
    assert rc == 0, out[-3000:]
    scored = json.loads(out[out.index("{") :])
    assert scored["task"] == "dpo" and scored["pairs"] == 16 and scored["step"] == data["train"]["steps"]
    assert scored["reward_accuracy"] >= 0.7 and scored["loss"] < math.log(2), scored

    export = Path(summary["export_dir"])
    assert (export / "config.json").is_file() and (export / "adapter" / "adapter_model.safetensors").is_file()


def _benchmarks_recorded(summary: dict, figures: dict, tmp_path: Path) -> None:
    """validate.benchmarks: the multiple-choice task was built from the held-out pairs (the chosen answer among its
    own words shuffled), lm-eval scored base and tuned, and the ledger row holds both per metric beside the DPO
    figures; its gate passed with the measured change."""
    assert (tmp_path / "bench-tasks" / "pref_demo_mc.yaml").is_file()
    docs = (tmp_path / "bench-tasks" / "pref_demo_mc.jsonl").read_text().splitlines()
    assert docs and all(len(json.loads(d)["choices"]) == 4 for d in docs)
    acc = figures["bench/pref_demo_mc/acc"]
    assert {"bench/pref_demo_mc/acc", "bench/pref_demo_mc/acc_norm"} <= set(figures), figures
    assert 0 <= acc.value <= 1 and 0 <= acc.base <= 1 and acc.stderr > 0, acc
    gate = next(v for v in summary["verdicts"] if v["name"] == "bench:pref_demo_mc/acc:max_drop")
    assert gate["passed"] and gate["measured"] == acc.value - acc.base, gate
    assert "benchmarks" in [s["stage"] for s in summary["stages"]]
