"""Off-peak windows and budgets through the real flow (injected clock, real training).

- `split`: a run stopped at a (short, injected) window end resumes in the next window's run and finishes with the
  same final loss as an unsplit run.
- budget: a run whose predicted cost exceeds the budget is refused before anything is rented (and the ledger says
  so); a run that would exceed it while training stops with a checkpoint.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import yaml

from tests.flows.test_pipeline import small_demo

TZ = ZoneInfo("Asia/Shanghai")
WINDOW = {"start": "02:00", "end": "06:00"}


def window_spec(tmp_path: Path, steps: int, **schedule) -> Path:
    """One node × 2 ranks, a longer run, the given schedule section."""
    p = small_demo(tmp_path, steps=steps, checkpoint_every=0, seq_len=128, global_batch=16)
    data = yaml.safe_load(p.read_text())
    data["cluster"].update({"nodes": 1, "gpus_per_node": 2})
    data["schedule"] = {"timezone": "Asia/Shanghai", "windows": [WINDOW], **schedule}
    p.write_text(yaml.safe_dump(data))
    return p


def final_loss(summary) -> float:
    from nightloom.metrics import read_metrics

    return read_metrics(Path(summary.run_dir) / "metrics.jsonl")[-1].loss


def test_split_resumes_next_window_with_same_final_loss(prefect_backend, tmp_path):
    from flows.pipeline import training_pipeline
    from nightloom.metrics import read_metrics

    steps = 500
    spec = window_spec(tmp_path / "split", steps, policy="split")
    # 40 s before the window ends: the trainer gets the window end as its deadline and stops mid-run
    near_end = datetime(2026, 11, 30, 5, 59, 20, tzinfo=TZ)
    first = training_pipeline(str(spec), now=near_end)
    assert first.status == "split", first
    assert 0 < int(first.reason.split(" after ")[1].split("/")[0]) < steps, first.reason
    assert "continues at 2026-12-01T02:00:00+08:00" in first.reason

    # the next window's run: same run id, resumes from the checkpoint, sharding not redone
    inside = datetime(2026, 12, 1, 2, 0, 5, tzinfo=TZ)
    second = training_pipeline(str(spec), resume_run_id=first.run_id, now=inside)
    assert second.status == "completed" and second.run_id == first.run_id
    metrics = read_metrics(Path(second.run_dir) / "metrics.jsonl")
    done = [m.step for m in metrics]
    assert done[-1] == steps and any(m.gap for m in metrics)
    assert sorted(set(done)) == list(range(1, steps + 1))

    unsplit = training_pipeline(str(window_spec(tmp_path / "whole", steps, policy="split")), now=inside)
    assert unsplit.status == "completed"
    assert final_loss(second) == pytest.approx(final_loss(unsplit), abs=1e-5)


def test_budget_refusal_before_renting(prefect_backend, tmp_path):
    from flows.pipeline import training_pipeline
    from nightloom.ledger import Ledger

    spec = window_spec(tmp_path, 10, policy="run-now")
    data = yaml.safe_load(spec.read_text())
    # llama2-7b on 8 × H100 for 100k steps at 2.0/GPU-hour cannot fit a budget of 50
    data["model"] = {"name": "llama2-7b"}
    data["cluster"].update({"nodes": 1, "gpus_per_node": 8, "gpu_type": "h100-80gb"})
    data["train"].update({"steps": 100000, "seq_len": 4096, "global_batch": 64})
    data["schedule"].update({"price_per_gpu_hour": 2.0, "budget": 50})
    spec.write_text(yaml.safe_dump(data))
    state = training_pipeline(str(spec), return_state=True)
    assert state.is_failed()
    assert "budget" in state.message.lower()
    rows = Ledger(data["ledger"]["url"]).list_runs()
    assert len(rows) == 1 and rows[0].status == "refused" and "budget" in rows[0].reason.lower()
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("cluster.json"))


def test_budget_stop_with_checkpoint(prefect_backend, tmp_path):
    from flows.pipeline import training_pipeline
    from nightloom.ledger import Ledger

    steps = 400
    # 2 ranks at 1800/rank-hour = 1 per second; a budget of 45 is spent 45 s after the gate
    spec = window_spec(tmp_path, steps, policy="run-now", price_per_gpu_hour=1800.0, offpeak_discount=0.0,
                       budget=45.0)
    outside = datetime(2026, 11, 30, 12, 0, tzinfo=TZ)
    summary = training_pipeline(str(spec), now=outside)
    assert summary.status == "stopped" and "budget" in summary.reason, summary
    ckpts = list((Path(summary.run_dir) / "checkpoints").glob("step-*"))
    assert ckpts, "a budget stop must leave a checkpoint"
    row = Ledger(yaml.safe_load(spec.read_text())["ledger"]["url"]).get(summary.ledger_id)
    assert row.status == "stopped"
