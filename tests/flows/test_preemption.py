"""Preemption, with real processes: SIGTERM to every rank of a running 2-rank job (checkpoint_every 0,
recovery.max_attempts 1) → the ranks agree on one step N, save checkpoints/step-N, exit preempted; the
orchestrator relaunches from step N+1 without spending an attempt, and the curve equals an uninterrupted run's.

Nothing here depends on timing: the signal is sent once metrics.jsonl holds 3 rows, and whatever step N the
ranks stop at, the test reads it from result files and metrics and compares whole curves.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.support.recovery import processes_mentioning, recovery_spec, reference_losses

pytestmark = pytest.mark.timeout(400)

#: as tests/flows/test_recovery.py: the same data order and global batch, only the float32 summation order of
#: 2 ranks against 1 differs (~1e-7); a wrong resume moves the loss by 1e-2 or more
LOSS_TOL = 1e-5
STEPS = 20


class SigtermRanks(threading.Thread):
    """Once the run's metrics.jsonl has >= 3 rows, SIGTERM every rank of attempt 0 (pids/rank-N.pid), once."""

    def __init__(self, runs_root: Path, ranks: int):
        super().__init__(daemon=True)
        self.root, self.ranks = runs_root, ranks
        self.sent_after: int | None = None  # rows in metrics.jsonl when the signals went
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for m in self.root.glob("*/metrics.jsonl"):
                rows = [x for x in m.read_text().splitlines() if x.strip().endswith("}")]
                pids = [m.parent / "pids" / f"rank-{r}.pid" for r in range(self.ranks)]
                if len(rows) >= 3 and all(p.is_file() for p in pids):
                    for p in pids:
                        os.kill(int(p.read_text()), signal.SIGTERM)
                    self.sent_after = len(rows)
                    return
            time.sleep(0.05)


def _cli(args: list[str]) -> tuple[int, str]:
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(args)
    return rc, buf.getvalue()


def test_sigterm_to_every_rank_saves_at_one_step_and_resumes_on_the_same_curve(prefect_backend, tmp_path):
    from nightloom.ledger import Ledger
    from nightloom.metrics import read_metrics
    from nightloom.spec.load import load_spec

    spec_path = recovery_spec(tmp_path, nodes=1, ranks=2, steps=STEPS, max_attempts=1)
    data = yaml.safe_load(spec_path.read_text())
    data["train"]["checkpoint_every"] = 0
    spec_path.write_text(yaml.safe_dump(data))
    spec = load_spec(spec_path)

    signaller = SigtermRanks(Path(spec.storage.root), ranks=2)
    signaller.start()
    try:
        rc, out = _cli(["run", str(spec_path), "--json"])
    finally:
        signaller.stop.set()
    assert signaller.sent_after is not None, "the run ended before 3 metrics rows were seen"
    assert rc == 0, out[-3000:]
    s = json.loads(out[out.index("{\n") :])
    run_dir = Path(s["run_dir"])

    # the preemption is named in the --json summary, and it spent no attempt (max_attempts 1 is still whole)
    assert s["status"] == "completed" and s["preemptions"] == 1 and s["interruptions"] == 0, s
    assert s["preemption_lost_s"] > 0

    # the ranks agreed on one step N and saved checkpoints/step-N there (checkpoint_every 0: no other before)
    ms = read_metrics(run_dir / "metrics.jsonl")
    first = [m.step for m in ms if m.attempt == 0]
    n = max(first)
    assert n >= signaller.sent_after and n < STEPS, (n, signaller.sent_after)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert ckpts == sorted({f"step-{n}", f"step-{STEPS}"}), ckpts
    assert json.loads((run_dir / "checkpoints" / f"step-{n}" / "meta.json").read_text())["step"] == n

    # the relaunch starts at step N+1; metrics.jsonl keeps every attempt's rows, one per step
    assert [m.step for m in ms] == list(range(1, STEPS + 1))
    assert first == list(range(1, n + 1)) and {m.attempt for m in ms if m.step > n} == {1}
    assert [m.step for m in ms if m.gap] == [n + 1]
    job1 = json.loads((run_dir / "job-attempt1.json").read_text())
    assert job1["resume"] and job1["attempt"] == 1

    # the ledger keeps the preemption apart from failures
    with Ledger(spec.ledger.url) as ledger:
        row = ledger.get(s["run_id"])
    assert row.status == "succeeded" and row.interruption_count == 0
    assert [i.kind for i in row.interruptions] == ["preemption"], row.interruptions
    assert f"step {n}/{STEPS}" in row.interruptions[0].detail

    # the whole curve equals an uninterrupted run's
    ref = reference_losses(run_dir / "job-attempt0.json", spec_path, tmp_path / "ref")
    diffs = [abs(a.loss - b) for a, b in zip(ms, ref)]
    print(f"\npreempted at step {n}; max |loss - uninterrupted| over {len(ref)} steps: {max(diffs):.2e}")
    assert len(ref) == STEPS and max(diffs) < LOSS_TOL
    assert not processes_mentioning(str(run_dir))
