"""RunSummary: what one pipeline run did, returned by the flow and printed by the CLI; and the rule that
gives a run its status."""

from __future__ import annotations

import base64
import html
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from nightloom.gates import Verdict
from nightloom.ledger.records import Figure
from nightloom.records import Record
from nightloom.track.records import TrackerStatus
from nightloom.train.job import TrainOutcome, TrainResult

#: what a table cell shows for a figure that is not there; never "-", which the Prefect UI's markdown renders
#: as a list bullet
NOT_MEASURED = "n/a"

#: one precision for a loss wherever the summary shows one (terminal, artifact, notebook)
LOSS = "{:.4f}"

if TYPE_CHECKING:
    from nightloom.sharding.manifest import ShardManifest


class StageTime(Record):
    stage: str
    seconds: float


class RunSummary(Record):
    """The outcome of `training_pipeline`: status, figures per stage, and where things were written."""

    run_id: str
    name: str
    status: str  # completed | failed | deferred | split | refused | stopped | preempted
    reason: str = ""
    run_dir: str = ""
    shards: int = 0
    shard_imbalance: float | None = None
    shards_balanced: bool | None = None
    layout: str = ""
    world_size: int = 0
    steps: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mfu_predicted: float | None = None
    peak_source: str = ""
    cost: float | None = None
    currency: str = ""
    ledger_id: str | None = None  # the ledger row key (the run id)
    verdicts: list[Verdict] = Field(default_factory=list)  # every gate's verdict, skipped ones included
    stages: list[StageTime] = Field(default_factory=list)
    next_run_at: str | None = None
    interruptions: int = 0  # failures recovered from (or given up on) during training
    recovery_s: float = 0.0  # total time to recover over those interruptions
    preemptions: int = 0  # attempts stopped by a preemption notice (saved at one step) and relaunched or not
    preemption_lost_s: float = 0.0  # their time lost: from each stop to the next attempt's first step
    export_dir: str | None = None  # the Hugging Face export (train.export: hf), written before the gates
    adapter_dir: str | None = None  # a LoRA run's PEFT adapter (AutoPeftModelForCausalLM loads it alone)
    checkpoint_bytes: int | None = None  # the last checkpoint's size (a LoRA run over model.weights: adapters only)
    nights_used: int = 0  # nights (stretches of renting) this run has used, this one included
    nights_left: int | None = None  # predicted nights still to come (None: unknown, no prediction)
    predicted_finish: str | None = None  # ISO time in the schedule's zone (None: unknown or finished)
    figures: list[Figure] = Field(default_factory=list)  # the task's own figures (benchmarks: bench/TASK/METRIC)
    trackers: list[TrackerStatus] = Field(default_factory=list)  # track: each tracker's run, rows sent and lost

    def loss_text(self) -> str:
        """'6.2457 -> 5.2698 over 30 steps' (n/a for a loss not measured)."""

        def f(x: float | None) -> str:
            return NOT_MEASURED if x is None else LOSS.format(x)

        return f"{f(self.first_loss)} -> {f(self.last_loss)} over {self.steps} steps"

    def _repr_html_(self) -> str:
        """Jupyter's display: a table of the run's figures and gates, and its loss curve inline (a PNG)."""
        rows = [
            ("run", self.run_id),
            ("status", self.status + (f" ({self.reason})" if self.reason else "")),
            ("layout", f"{self.layout or NOT_MEASURED} on {self.world_size} ranks"),
            ("loss", self.loss_text()),
            ("tokens/s", NOT_MEASURED if self.tokens_per_s is None else f"{self.tokens_per_s:,.0f}"),
            ("MFU", NOT_MEASURED if self.mfu is None else f"{self.mfu:.2%}"),
            *((f"gate {v.name}", f"{v.label}: {v.reason}") for v in self.verdicts),
            *self.figure_rows(),
            ("stages", ", ".join(f"{s.stage} {s.seconds:.1f} s" for s in self.stages)),
            ("run dir", self.run_dir),
            *self.output_rows(),
        ]
        body = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>{html.escape(v)}</td></tr>"
            for k, v in rows
        )
        png = loss_png(self.run_dir)
        img = f"<img alt='loss curve' src='data:image/png;base64,{png}'/>" if png else ""
        return f"<table><caption>nightloom run {html.escape(self.name)}</caption>{body}</table>{img}"

    def output_rows(self) -> list[tuple[str, str]]:
        """('export', folder) and ('adapter', folder) where the run wrote them: the summary's own fields, which
        either backend's result fills (add_training), so every view names the same paths."""
        rows = [("export", self.export_dir), ("adapter", self.adapter_dir)]
        if self.checkpoint_bytes is not None:
            rows.append(("checkpoint", f"{self.checkpoint_bytes / 2**20:,.1f} MiB"))
        rows += [(t.tracker, t.note()) for t in self.trackers]  # track: the tracker's run, what it never got
        return [(k, v) for k, v in rows if v]

    def figure_rows(self) -> list[tuple[str, str]]:
        """(name, 'base 0.2500 -> 0.6000 (+0.3500, stderr 0.1000)') per figure; the value alone without a base."""
        out = []
        for f in self.figures:
            err = f", stderr {f.stderr:.4f}" if f.stderr is not None else ""
            if f.base is None:
                out.append((f.name, f"{f.value:.4f}" + (f" ({err[2:]})" if err else "")))
            else:
                out.append((f.name, f"base {f.base:.4f} -> {f.value:.4f} ({f.value - f.base:+.4f}{err})"))
        return out

    def preemptions_text(self) -> str:
        """'2 (41.3 s lost)': the preemptions row (CLI and artifact)."""
        return f"{self.preemptions} ({self.preemption_lost_s:.1f} s lost)"

    def nights_text(self) -> str:
        """'2 used, 1 left; predicted finish 2026-12-03T02:24:00+08:00' (the run-summary row)."""
        left = "unknown" if self.nights_left is None else str(self.nights_left)
        finish = f"; predicted finish {self.predicted_finish}" if self.predicted_finish else ""
        return f"{self.nights_used} used, {left} left{finish}"

    def add_shards(self, manifest: ShardManifest) -> None:
        """The shard stage's figures."""
        self.shards, self.shard_imbalance, self.shards_balanced = (
            manifest.num_shards,
            manifest.imbalance,
            manifest.balanced,
        )

    def not_run(self, status: str, reason: str, next_run_at: str | None, stages: list[StageTime]) -> RunSummary:
        """The summary of a run the window gate did not start now (deferred to `next_run_at`)."""
        self.status, self.reason, self.next_run_at, self.stages = status, reason, next_run_at, stages
        return self

    def add_nights(self, used: int, left: int | None, predicted_finish: str | None) -> None:
        """Nights used (this one included), nights predicted to come, and the predicted finish."""
        self.nights_used, self.nights_left, self.predicted_finish = used, left, predicted_finish

    def add_training(self, trained: TrainOutcome, predicted_mfu: float | None) -> None:
        """The train stage's figures: the layout and size the run finished on, the plan's MFU, interruptions."""
        self.layout, self.world_size, self.mfu_predicted = (
            trained.plan.layout(),
            trained.cluster.world_size,
            predicted_mfu,
        )
        self.interruptions, self.recovery_s = trained.interruptions, round(trained.recovery_s, 2)
        self.preemptions, self.preemption_lost_s = trained.preemptions, round(trained.preemption_lost_s, 2)
        self.add_outputs(trained.result)

    def add_outputs(self, result: TrainResult) -> None:
        """Where the trained model went, from the result record: `export_dir` and `adapter_dir` (an XTuner
        result that names its full model `model_dir` only fills the export row with it)."""
        self.export_dir = result.export_dir or getattr(result, "model_dir", None)
        self.adapter_dir = result.adapter_dir
        self.checkpoint_bytes = getattr(result, "checkpoint_bytes", None)


def loss_png(run_dir: str) -> str | None:
    """The run's loss curve as base64 PNG: its `loss.png` (written with the gates), else drawn from its metrics;
    None when the run has no metrics."""
    from nightloom.metrics import read_metrics
    from nightloom.plots import plot_loss
    from nightloom.runfiles import RunFiles

    if not run_dir:
        return None
    path = Path(run_dir) / "loss.png"
    if not path.is_file():
        metrics = RunFiles(run_dir).metrics
        if not metrics.is_file() or not (steps := read_metrics(metrics)):
            return None
        path = plot_loss(steps, Path(run_dir) / "loss.png")
    return base64.b64encode(path.read_bytes()).decode()


#: the longest line of a table artifact's text cell: Prefect's UI cuts a cell at the table's edge (no wrapping)
ARTIFACT_LINE = 72


def wrapped_rows(rows: list[dict], column: str = "value", width: int = ARTIFACT_LINE) -> list[dict]:
    """Table artifact rows with each long `column` text broken between words onto continuation rows (the other
    cells empty), since the UI's table cells do not wrap; a word longer than `width` (a path) stays whole."""
    out = []
    for row in rows:
        text = row.get(column)
        lines = textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) if text else []
        out.append({**row, column: lines[0]} if lines else row)
        out += [{**dict.fromkeys(row, ""), column: line} for line in lines[1:]]
    return out


def summary_rows(
    summary: RunSummary, verdicts, time_to_ready_s: float, cost: float, currency: str, stages: list[StageTime]
) -> list[dict[str, str]]:
    """The run-summary table artifact: one (field, value) row per figure, gate and stage."""

    def fmt(x, spec: str) -> str:
        return spec.format(x) if x else NOT_MEASURED

    return [
        {"field": "status", "value": summary.status},
        {"field": "shards", "value": f"{summary.shards} (imbalance {summary.shard_imbalance:.2%})"},
        {"field": "layout", "value": f"{summary.layout} on {summary.world_size} ranks"},
        {"field": "loss", "value": summary.loss_text()},
        {"field": "tokens/s", "value": fmt(summary.tokens_per_s, "{:,.0f}")},
        {"field": "MFU", "value": fmt(summary.mfu, "{:.2%}") + (f" ({summary.peak_source})" if summary.mfu else "")},
        {"field": "MFU planned", "value": fmt(summary.mfu_predicted, "{:.2%}")},
        {"field": "time to ready", "value": f"{time_to_ready_s:.1f} s"},
        *([{"field": "preemptions", "value": summary.preemptions_text()}] if summary.preemptions else []),
        *(  # costs and nights only where a price is set (without one a run costs 0.00 by definition)
            [{"field": "cost", "value": f"{cost:.2f} {currency}"}, {"field": "nights", "value": summary.nights_text()}]
            if cost
            else []
        ),
        *({"field": f"gate {v.name}", "value": f"{v.label}: {v.reason}"} for v in verdicts),
        *({"field": k, "value": v} for k, v in summary.figure_rows()),
        *({"field": f"stage {s.stage}", "value": f"{s.seconds:.1f} s"} for s in stages),
        {"field": "ledger row", "value": summary.run_id},
        *({"field": k, "value": v} for k, v in summary.output_rows()),
    ]


@dataclass(frozen=True)
class RunStatus:
    """How a run that trained ends: the summary's status, the ledger row's status, and the reason."""

    summary: str  # completed | failed | split | stopped
    ledger: str  # succeeded | failed | stopped
    reason: str = ""


def run_status(passed: bool, result: TrainResult, deadline_kind: str | None) -> RunStatus:
    """The status rule: the gates decide completed/failed; a run that passed but stopped before its last step
    (a window end under `split`, or the budget) is split (continues in the next window) or stopped."""
    if not passed:
        return RunStatus("failed", "failed")
    if result.stopped == "completed":
        return RunStatus("completed", "succeeded")
    if result.stopped == "preempted":  # not relaunched: the orchestrator was stopped, or max_preemptions used
        return RunStatus(
            "preempted",
            "stopped",
            f"preempted at step {result.steps_done}/{result.total_steps} (checkpoint {result.last_checkpoint}); "
            "continue with nightloom run SPEC --resume RUN_ID",
        )
    kind = deadline_kind or "deadline"
    reason = (
        f"stopped at the {kind} end after {result.steps_done}/{result.total_steps} steps "
        f"(checkpoint {result.last_checkpoint})"
    )
    return RunStatus("split" if kind == "window" else "stopped", "stopped", reason)
