"""The README's GRPO demo (deployments/grpo-demo.yaml), run as shipped through `nightloom run` but with its build
folders under tmp: prompts and their `answer` column sharded, the tiny model sampling and scoring groups of
completions inside the training rank with the demo's reward file, the held-out mean reward rising by more than three
standard errors (and the reward_gain gate passing on it), TRL's figures on every metrics row, the ledger's row task
grpo with the held-out reward before and after, and the sampled completions' table as a file and an artifact. The
random base is built on first use, the export carries the bytes tokenizer's Hugging Face form, and lm-eval scores
base and tuned on the generative task built from the held-out prompts: both in the ledger, the digits gate passing."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "deployments" / "grpo-demo.yaml"
TRL_NAMES = ("reward", "reward_std", "rewards/digits/mean", "completions/mean_length", "completions/clipped_ratio",
             "clip_ratio/region_mean", "entropy", "num_tokens")  # fmt: skip


def _cli(args: list[str]) -> tuple[int, str]:
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(args)
    return rc, buf.getvalue()


@pytest.mark.slow
def test_grpo_demo_runs_as_shipped(prefect_backend, tmp_path):
    from prefect.client.orchestration import get_client

    from nightloom.ledger import Ledger

    data = yaml.safe_load(DEMO.read_text())
    data["dataset"]["path"] = str(DEMO.parent / data["dataset"]["path"])
    data["train"]["grpo"]["rewards"][0]["fn"] = str(DEMO.parent / data["train"]["grpo"]["rewards"][0]["fn"])
    data["sharding"]["output"] = str(tmp_path / "shards")
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    data["model"]["weights"] = str(tmp_path / "models" / "llama")
    data["validate"]["benchmarks"]["include_path"] = str(tmp_path / "bench-tasks")
    spec = tmp_path / "grpo-demo.yaml"
    spec.write_text(yaml.safe_dump(data))

    rc, out = _cli(["run", str(spec), "--json"])
    assert rc == 0, out[-5000:]
    summary = json.loads(out[out.index("{\n") :])
    assert summary["status"] == "completed" and summary["steps"] == data["train"]["steps"], summary
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["keep_columns"] == ["answer"]

    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert all(name in row for row in rows for name in TRL_NAMES)
    before, after = rows[0]["start_eval_reward"], rows[-1]["eval_reward"]
    se = math.hypot(rows[0]["start_eval_reward_se"], rows[-1]["eval_reward_se"])
    print(f"held-out mean reward {before:.3f} -> {after:.3f} (3 SE {3 * se:.3f})")
    assert after - before > 3 * se, (before, after, se)
    gates = {v["name"]: v for v in summary["verdicts"]}
    assert gates["reward_gain"]["passed"] and gates["reward_gain"]["measured"] == pytest.approx(after - before)

    ledger = Ledger(data["ledger"]["url"])
    try:
        row = ledger.get(summary["run_id"])
    finally:
        ledger.close()
    figures = {f.name: f for f in row.figures}
    assert row.task == "grpo" and figures["eval_reward"].base == before and figures["eval_reward"].value == after
    _benchmarks_recorded(summary, figures, tmp_path)

    table = json.loads((Path(summary["run_dir"]) / "completions" / f"step-{len(rows):06d}.json").read_text())
    assert len(table["rows"]) == 32 and all(r["prompt"].endswith("=") for r in table["rows"])

    async def latest():
        async with get_client() as client:
            return await client.read_latest_artifacts()

    artifacts = {a.key: a for a in asyncio.run(latest())}
    shown = artifacts["grpo-completions"].data
    shown = yaml.safe_load(shown) if isinstance(shown, str) else shown
    assert [r["completion"] for r in shown] == [r["completion"] for r in table["rows"]]


def _benchmarks_recorded(summary: dict, figures: dict, tmp_path: Path) -> None:
    """validate.benchmarks: the task built from every held-out prompt with its answer, lm-eval's scores of the base
    (built on first use, cached after) and the export (its tokenizer.json the bytes') in the ledger, the gate on
    `digits` (what the demo learns) passing."""
    held = json.loads((tmp_path / "shards" / "manifest.json").read_text())["heldout"]["rows"]
    assert len((tmp_path / "bench-tasks" / "grpo_demo_sum.jsonl").read_text().splitlines()) == held
    assert (tmp_path / "models" / "llama" / "config.json").is_file()
    assert (Path(summary["export_dir"]) / "tokenizer.json").is_file()
    exact, digits = figures["bench/grpo_demo_sum/exact_match"], figures["bench/grpo_demo_sum/digits"]
    print(f"lm-eval grpo_demo_sum: exact_match {exact.base:.3f} -> {exact.value:.3f}, digits {digits.base:.3f} -> "
          f"{digits.value:.3f} (benchmarks stage {_stage_s(summary, 'benchmarks'):.1f} s)")  # fmt: skip
    assert all(0 <= f.base <= 1 and 0 <= f.value <= 1 and f.stderr is not None for f in (exact, digits))
    gate = next(v for v in summary["verdicts"] if v["name"] == "bench:grpo_demo_sum/digits:min_gain")
    assert gate["passed"] and gate["measured"] == pytest.approx(digits.value - digits.base), gate
    assert len(list((tmp_path / "runs" / ".benchmarks").glob("base-*.json"))) == 1


def _stage_s(summary: dict, name: str) -> float:
    return sum(s["seconds"] for s in summary["stages"] if s["stage"] == name)
