"""The flow's end of a run for its trackers: the same tracker runs the training attempts wrote to (their ids from
tracking.json) get the resolved spec and the plan as parameters, the gates' verdicts and the task's figures, the
plots and the run summary as artifacts, the export's path and the ledger's row as tags, and their end. A tracker
that is down gets until track.flush_s; then its failure, like every row an attempt could not deliver, is in the
returned statuses (the summary and the ledger row say it), never raised: a tracker never fails a run."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.engine import make_url

from nightloom.gates import Verdict
from nightloom.ledger.records import Figure
from nightloom.parallel import ParallelPlan
from nightloom.spec import RunSpec
from nightloom.track.attempt import tracker_run
from nightloom.track.records import TrackerStatus, TrackingFile, scrub, step_ranges
from nightloom.util import atomic_write_text

SUMMARY_FILE = "summary.json"
T = TypeVar("T")


@dataclass
class RunEnd:
    """What the flow knows at the end of a run, for its trackers."""

    spec: RunSpec
    run_id: str
    run_dir: Path
    plan: ParallelPlan | None
    succeeded: bool
    summary: dict[str, Any]  # the RunSummary, as JSON
    verdicts: list[Verdict] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    export_dir: str | None = None


def flat_params(spec: RunSpec, plan: ParallelPlan | None) -> dict[str, str]:
    """The resolved spec and the plan as flat parameters (`spec.train.lr` -> '0.0003', `plan.tp` -> '2'); the
    ledger URL without its password (a spec holds none elsewhere: the trackers' credentials are refused)."""
    data = spec.model_dump(mode="json", by_alias=True)
    data["ledger"]["url"] = make_url(spec.ledger.url).render_as_string(hide_password=True)
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("spec", data)
    if plan is not None:
        walk("plan", plan.model_dump(mode="json"))
    return out


def verdict_values(verdicts: Iterable[Verdict], figures: Iterable[Figure]) -> dict[str, float]:
    """`verdict/<gate>/passed` (1 or 0) and `/measured` of each gate that ran, and each figure's value."""
    out: dict[str, float] = {}
    for v in verdicts:
        if v.skipped:
            continue
        out[f"verdict/{v.name}/passed"] = 1.0 if v.passed else 0.0
        if v.measured is not None:
            out[f"verdict/{v.name}/measured"] = float(v.measured)
    for f in figures:
        out[f"figure/{f.name}"] = float(f.value)
    return out


def _until(deadline: float, fn: Callable[[], T], backoff_s: float = 0.5) -> T:
    """`fn()`, tried again with backoff until it succeeds or the deadline passes (then its last error)."""
    while True:
        try:
            return fn()
        except Exception:
            if time.monotonic() + backoff_s > deadline:
                raise
            time.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)


def _finish_one(name: str, end: RunEnd, known: str | None, deadline: float) -> TrackerStatus:
    status = TrackerStatus(tracker=name, run_id=known)
    try:
        run = tracker_run(name, end.spec.track, end.run_dir, end.run_id, known)
        status.where = run.where
        status.run_id = _until(deadline, run.open)
        _until(deadline, lambda: run.log_params(flat_params(end.spec, end.plan)))
        steps = int(end.summary.get("steps") or 0)
        _until(deadline, lambda: run.log_values(verdict_values(end.verdicts, end.figures), steps))
        tags = {"nightloom.run_id": end.run_id, "nightloom.status": str(end.summary.get("status", ""))}
        tags |= {"nightloom.export": end.export_dir or "", "nightloom.spec_hash": end.spec.spec_hash()}
        _until(deadline, lambda: run.set_tags(tags))
        for path in [end.run_dir / SUMMARY_FILE, *sorted(end.run_dir.glob("*.png"))]:
            _until(deadline, lambda p=path: run.log_artifact(p))
        _until(deadline, lambda: run.finish(end.succeeded))
    except Exception as e:
        status.error = scrub(f"end of run: {type(e).__name__}: {e}")[:500]
    return status


def finish_trackers(end: RunEnd) -> list[TrackerStatus]:
    """Finish every tracker run of `end.spec.track` (see the module's text); one status per tracker, the rows its
    attempts sent and lost added up."""
    track = end.spec.track
    if not track.enabled():
        return []
    atomic_write_text(end.run_dir / SUMMARY_FILE, json.dumps(end.summary, indent=2, default=str) + "\n")
    file = TrackingFile.load(end.run_dir)
    deadline = time.monotonic() + track.flush_s
    out = []
    for name in track.enabled():
        status = _finish_one(name, end, file.runs.get(name), deadline)
        if status.run_id:
            file.runs[name] = status.run_id
        past = [s for attempt in file.attempts for s in attempt if s.tracker == name]
        status.sent = sum(s.sent for s in past)
        status.lost = sum(s.lost for s in past)
        status.failures += sum(s.failures for s in past)
        status.lost_steps = step_ranges([int(x) for s in past for x in _steps(s.lost_steps)])
        status.error = status.error or next((s.error for s in reversed(past) if s.lost), None)
        out.append(status)
    file.save(end.run_dir)
    return out


def _steps(ranges: str) -> list[int]:
    """'4-6, 9' -> [4, 5, 6, 9]."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in ranges.split(","))):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out
