"""Fault injection for recovery tests: a Chaos thread that kills a rank at a step, unhealthy-node markers; and the
uninterrupted one-process run whose curve a recovered or preempted run must match."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from bench._support import Chaos, mark_unhealthy, run_under_chaos  # one fault injector for tests and benchmarks
from tests.support.pipeline import ROOT, small_demo

__all__ = [
    "Chaos",
    "mark_unhealthy",
    "processes_mentioning",
    "recovery_spec",
    "reference_losses",
    "run_under_chaos",
    "task_runs_named",
]


def recovery_spec(tmp_path: Path, nodes: int, ranks: int, steps: int, **recovery) -> Path:
    p = small_demo(tmp_path, steps=steps, checkpoint_every=4, seq_len=64, collective_timeout_s=20)
    data = yaml.safe_load(p.read_text())
    data["cluster"].update(
        {
            "nodes": nodes,
            "gpus_per_node": ranks,
            "name": f"rec-{tmp_path.name}",
            "master_port": 20000 + os.getpid() % 5000,
        }
    )
    data["recovery"] = {"max_attempts": 2, "max_minutes": 10, "allow_relayout": True, **recovery}
    p.write_text(yaml.safe_dump(data))
    return p


def reference_losses(job_file: Path, spec_path: Path, out: Path) -> list[float]:
    """The same job, uninterrupted, in one plain process (world size 1: grad_accum makes up the batch): the curve an
    interrupted and resumed run (a killed rank, a preemption) must match step for step."""
    from nightloom.metrics import read_metrics
    from nightloom.planner import plan_for_spec
    from nightloom.spec.load import load_spec
    from nightloom.train.job import TrainJob

    job = TrainJob.model_validate_json(job_file.read_text())
    plan = plan_for_spec(load_spec(spec_path), world_size=1).chosen
    ref = job.model_copy(
        update={"run_dir": str(out), "plan": plan, "attempt": 0, "peak_flops": 1e9, "peak_source": "test"}
    )
    out.mkdir()
    (out / "job.json").write_text(ref.model_dump_json())
    r = subprocess.run(
        [sys.executable, "-m", "nightloom.train", "--job", str(out / "job.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [m.loss for m in read_metrics(out / "metrics.jsonl")]


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds `text` (our ranks carry the run folder in --job)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if text.encode() in (p / "cmdline").read_bytes() and (p / "stat").read_text().split()[2] != "Z":
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def task_runs_named(flow_run_id, name: str) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName

    with get_client(sync_client=True) as c:
        return c.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)),
        )
