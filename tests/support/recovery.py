"""Fault injection for recovery tests: a Chaos thread that kills a rank at a step, unhealthy-node markers."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.support.pipeline import small_demo


class Chaos(threading.Thread):
    """At (attempt, step) kill one rank's process group; first make its node unhealthy when a callable is
    given (a node that would fail preflight now, as a dead GPU does)."""

    def __init__(self, runs_root: Path, faults: list[tuple[int, int, int, Callable[[], None] | None]]):
        super().__init__(daemon=True)
        self.root, self.faults = runs_root, list(faults)
        self.done: list[tuple[int, int, int]] = []
        self.stop = threading.Event()

    def _metrics(self) -> tuple[Path | None, list[dict]]:
        for m in self.root.glob("*/metrics.jsonl"):
            lines = [json.loads(x) for x in m.read_text().splitlines() if x.strip().endswith("}")]
            return m.parent, lines
        return None, []

    def run(self) -> None:
        while self.faults and not self.stop.is_set():
            run_dir, lines = self._metrics()
            attempt, min_step, rank, sicken = self.faults[0]
            hit = [x for x in lines if x.get("attempt", 0) == attempt and x["step"] >= min_step]
            if run_dir is not None and hit:
                if sicken is not None:
                    sicken()
                pid = int((run_dir / "pids" / f"rank-{rank}.pid").read_text())
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.done.append((attempt, hit[0]["step"], rank))
                self.faults.pop(0)
            time.sleep(0.05)


def run_under_chaos(spec_path: Path, runs_root: Path, faults) -> tuple[Chaos, object]:
    """Run the pipeline on `spec_path` while a Chaos thread injects `faults`; (chaos, the flow's final state)."""
    from flows.pipeline import training_pipeline

    chaos = Chaos(runs_root, faults)
    chaos.start()
    try:
        state = training_pipeline(str(spec_path), return_state=True)
    finally:
        chaos.stop.set()
    return chaos, state


def mark_unhealthy(folder: Path, node: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / node).write_text("injected by the test\n")


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
