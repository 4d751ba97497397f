"""What a run's trackers did, typed: each tracker's run id and delivery (sent, lost, failures), kept in the run
folder's tracking.json so a relaunched attempt resumes the same tracker runs and the flow finishes them."""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import Field

from nightloom.ledger.records import Figure
from nightloom.records import Record
from nightloom.util import atomic_write_text

TRACKING_FILE = "tracking.json"
SECRET_ENV = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY")  # never written anywhere
_SECRETISH = re.compile(r"(?i)(secret|password|token|api_key|key)=\S+")


class TrackerStatus(Record):
    """One tracker's delivery of one attempt (or of the flow's end-of-run logging): its run, where it lives, how
    many metric rows it took, how many it never got (and their steps), and the last error met."""

    tracker: str
    run_id: str | None = None
    where: str = ""
    sent: int = 0
    lost: int = 0
    lost_steps: str = ""  # '4-15, 20': the steps never delivered, as ranges
    failures: int = 0  # failed tries (each retried), delivered afterwards or not
    error: str | None = None

    def note(self) -> str:
        """'mlflow run 3f2a… : 30 steps sent' or '..., 12 lost (steps 4-15): <error>' for the summary."""
        head = f"{self.tracker} run {self.run_id or '(none)'}: {self.sent} rows sent"
        if self.failures:
            head += f" after {self.failures} failed tries"
        if self.lost:
            head += f"; {self.lost} LOST (steps {self.lost_steps or '?'}): {self.error or 'not delivered in time'}"
        return head


def step_ranges(steps: list[int]) -> str:
    """[4, 5, 6, 9] -> '4-6, 9'."""
    spans: list[list[int]] = []
    for s in sorted(set(steps)):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


class TrackingFile(Record):
    """tracking.json: each tracker's run id (so every attempt and the flow write to one run) and what each attempt's
    delivery came to."""

    runs: dict[str, str] = Field(default_factory=dict)  # tracker -> its run id
    attempts: list[list[TrackerStatus]] = Field(default_factory=list)

    @classmethod
    def load(cls, run_dir: str | Path) -> TrackingFile:
        path = Path(run_dir) / TRACKING_FILE
        return cls.model_validate_json(path.read_text()) if path.exists() else cls()

    def save(self, run_dir: str | Path) -> None:
        atomic_write_text(Path(run_dir) / TRACKING_FILE, self.model_dump_json(indent=2) + "\n")

    def lost(self) -> dict[str, int]:
        """Rows each tracker never got, over every attempt."""
        out: dict[str, int] = {}
        for attempt in self.attempts:
            for s in attempt:
                out[s.tracker] = out.get(s.tracker, 0) + s.lost
        return out


def scrub(text: str) -> str:
    """`text` without any credential: the values of SECRET_ENV set in this process, and `key=value` secrets."""
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return _SECRETISH.sub(r"\1=***", text)


def tracker_figures(statuses: list[TrackerStatus]) -> list[Figure]:
    """The ledger row's record of its trackers (schema 7's figures, no new column): `track/<tracker>/<run id>`,
    its value the rows that tracker never got (0: every step delivered)."""
    return [Figure(name=f"track/{s.tracker}/{s.run_id}", value=float(s.lost)) for s in statuses if s.run_id]


def tracker_runs(figures: list[Figure]) -> dict[str, str]:
    """tracker -> run id, read back from a ledger row's figures."""
    out = {}
    for f in figures:
        if f.name.startswith("track/"):
            _, tracker, run_id = f.name.split("/", 2)
            out[tracker] = run_id
    return out


#: (tracker, its setting naming a Prefect Secret block, the environment variable its client reads)
SECRET_SETTINGS = (("mlflow", "token_secret", "MLFLOW_TRACKING_TOKEN"), ("wandb", "api_key_secret", "WANDB_API_KEY"))


def secret_env(track, resolve) -> dict[str, str]:
    """The trackers' credentials named as secret blocks in `track` (a TrackSpec), as the environment variables their
    clients read: `resolve(block name) -> value` (tasks/ reads Prefect's Secret blocks). Only the ranks' and the
    flow's environment ever holds them, never a file."""
    out = {}
    for tracker, setting, var in SECRET_SETTINGS:
        section = getattr(track, tracker)
        name = getattr(section, setting) if section is not None else None
        if name:
            out[var] = resolve(name)
    return out
