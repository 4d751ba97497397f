"""Validation task: MFU and convergence gates on the run's metrics, plots, and the artifacts users look at."""

from __future__ import annotations

import base64
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from nightloom.gates import (
    MfuReport,
    Verdict,
    measure_mfu,
    mfu_inputs,
    resolve_golden,
    resolve_peak,
    validate_run,
)
from nightloom.ledger import Ledger
from nightloom.ledger.records import Figure
from nightloom.metrics import read_metrics
from nightloom.parallel import ParallelPlan
from nightloom.perf import PeakMeasurement
from nightloom.plots import write_run_plots
from nightloom.runfiles import RunFiles
from nightloom.shape import ModelShape
from nightloom.spec import RunSpec
from nightloom.train.job import TrainResult
from nightloom.train.preference.figures import preference_figures
from nightloom.train.rollout.figures import grpo_figures


class ValidationOutcome(BaseModel):
    """Verdicts plus the measured figures the ledger and summary need."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    verdicts: list[Verdict]
    first_loss: float | None = None
    last_loss: float | None = None
    steps: int = 0
    tokens_per_s: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    precision: str | None = None
    peak_source: str | None = None
    plots: dict[str, str] = {}
    figures: list[Figure] = []  # the task's own figures for the ledger (benchmarks: bench/TASK/METRIC)

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)


def png_markdown(title: str, path: Path) -> str:
    """A PNG embedded as a data URI, so it renders in the Prefect UI without a file server."""
    b64 = base64.b64encode(Path(path).read_bytes()).decode()
    return f"### {title}\n![{title}](data:image/png;base64,{b64})\n\n`{path}`\n"


def _steps(metrics_path: Path, stopped_early: bool) -> list:
    """The run's steps; none (no file, or one a resume rewound) only for a run stopped at a window or budget end."""
    if not stopped_early:
        return read_metrics(metrics_path)
    return read_metrics(metrics_path, allow_empty=True) if metrics_path.is_file() else []


@task(name="validate", cache_policy=NO_CACHE)
def validate_task(
    spec: RunSpec, run_dir: Path, plan: ParallelPlan, result: TrainResult, shape: ModelShape, world_size: int
) -> ValidationOutcome:
    """Run every configured gate; publish the loss/throughput/MFU plots. Failing gates are returned, not raised,
    so the ledger records them before the flow fails."""
    log = get_run_logger()
    metrics_path = RunFiles(run_dir).metrics
    stopped_early = result.stopped != "completed"
    steps = _steps(metrics_path, stopped_early)
    if not steps:  # stopped before step 1: one skipped verdict, no plots
        verdicts = validate_run([], spec.validate_, stopped_early=True)
        log.warning("gate %s: %s", verdicts[0].name, verdicts[0].reason)
        return ValidationOutcome(verdicts=verdicts)
    gpu_type = spec.cluster.gpu_type
    measured = None
    if gpu_type == "cpu" and result.peak_flops:
        measured = PeakMeasurement(result.peak_flops, "fp32", result.peak_source or "measured on CPU")
    peak = resolve_peak(gpu_type, spec.train.precision, measured)
    xt = spec.train.xtuner if spec.train.backend == "xtuner" else None
    inputs = mfu_inputs(
        shape,
        spec.train.seq_len,
        plan.recompute,
        world_size,
        peak,
        predicted_mfu=plan.mfu,
        frozen_base=xt is not None and xt.method != "full",
    )
    ledger = Ledger(spec.ledger.url)
    try:
        golden = resolve_golden(spec.validate_.golden, ledger, spec.spec_hash())
    finally:
        ledger.close()
    verdicts = validate_run(steps, spec.validate_, inputs, golden, stopped_early=stopped_early, task=spec.train.task)
    report: MfuReport | None = measure_mfu(steps, inputs)
    for v in verdicts:
        (log.info if v.passed else log.error)("gate %-12s %s: %s", v.name, v.label, v.reason)

    plots = write_run_plots(
        steps,
        run_dir,
        predicted_mfu=plan.mfu,
        mfu_floor=spec.validate_.mfu_floor or None,
        golden=golden.steps if golden is not None else None,
    )
    md = "\n".join(png_markdown(name.replace("_", " "), p) for name, p in plots.items())
    create_markdown_artifact(key="loss-curve", markdown=md, description="Loss, tokens/s and MFU per step")
    return ValidationOutcome(
        verdicts=verdicts,
        first_loss=steps[0].loss,
        last_loss=steps[-1].loss,
        steps=len(steps),
        tokens_per_s=report.tokens_per_s if report else None,
        mfu=report.mfu if report else None,
        hfu=report.hfu if report else None,
        precision=peak.precision,
        peak_source=peak.source,
        plots={k: str(v) for k, v in plots.items()},
        figures=preference_figures(steps) + grpo_figures(steps),  # dpo: held-out reward accuracy...; grpo: reward
    )
