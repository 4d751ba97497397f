"""Per-step training metrics: the JSONL format every backend writes and validation, ledger and plots read."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

#: Prometheus metrics the trainer exports per rank (labels below); the Grafana dashboard may query only these.
PROMETHEUS_METRICS: tuple[str, ...] = (
    "nightloom_step",
    "nightloom_loss",
    "nightloom_grad_norm",
    "nightloom_tokens_per_second",
    "nightloom_step_time_seconds",
    "nightloom_mfu",
    "nightloom_memory_bytes",
    "nightloom_collective_latency_seconds",
)
#: Exported only by runs with held-out evaluation (validate.eval_every > 0), from the first evaluation on.
PROMETHEUS_EVAL_METRICS: tuple[str, ...] = ("nightloom_eval_loss", "nightloom_eval_perplexity")
#: Exported only by mixture-of-experts runs: tokens routed to each expert in the last step (label `expert`), their
#: max/mean, and the router's load-balancing loss (unscaled).
PROMETHEUS_MOE_METRICS: tuple[str, ...] = (
    "nightloom_expert_tokens",
    "nightloom_expert_imbalance",
    "nightloom_router_aux_loss",
)
PROMETHEUS_LABELS: tuple[str, ...] = ("run", "rank")


class MetricsError(ValueError):
    """A missing, truncated or corrupt metrics file; the message names the file and line."""


class StepMetrics(BaseModel):
    """One optimizer step as seen by rank 0."""

    model_config = ConfigDict(extra="allow")
    step: int
    loss: float
    grad_norm: float | None = None
    lr: float | None = None
    # ids computed in this step (global), padding included (unpacked sft: each micro-batch to its longest row)
    tokens: int = 0
    tokens_per_s: float | None = None  # tokens / step_time_s: what the model computed per second (MFU's rate)
    label_tokens: int | None = None  # targets the loss is over (sft: assistant tokens; pretraining: = tokens)
    label_tokens_per_s: float | None = None  # label_tokens / step_time_s: what training is for
    flops: float | None = None  # model FLOPs of the step as computed (PaLM at each micro-batch's width), global
    hardware_flops: float | None = None  # the same with recomputation (HFU)
    step_time_s: float | None = None
    peak_mem_bytes: int | None = None
    mfu: float | None = None
    hfu: float | None = None
    time: float | None = None  # unix time at step end
    attempt: int = 0  # recovery attempt that produced this step
    gap: bool = False  # first step after a resume (a gap in the curve)
    world_size: int | None = None  # devices that ran this step (a recovery may shrink the cluster mid-run)
    eval_loss: float | None = None  # held-out token-weighted mean NLL after this step (when evaluated)
    eval_ppl: float | None = None  # exp(eval_loss)
    eval_tokens: int | None = None  # predicted tokens the eval loss averages over
    # mixture of experts: top-k assignments per expert this step (global batch, summed over the MoE layers), their
    # max/mean (1.0 = balanced) and the router's load-balancing loss (unscaled; the loss above includes coef times it)
    expert_tokens: list[int] | None = None
    expert_imbalance: float | None = None
    router_aux_loss: float | None = None


def append_metrics(path: Path, m: StepMetrics) -> None:
    """Append one line (flushed) so a reader sees whole lines only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(m.model_dump(exclude_none=True), allow_nan=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()


def read_metrics(path: str | Path, allow_empty: bool = False) -> list[StepMetrics]:
    """Read a metrics JSONL; raise MetricsError naming file:line for a truncated or corrupt line."""
    p = Path(path)
    if not p.is_file():
        raise MetricsError(f"{p}: metrics file not found")
    text = p.read_text(encoding="utf-8", errors="strict")
    out: list[StepMetrics] = []
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if i == len(lines) and not text.endswith("\n"):
            raise MetricsError(f"{p}:{i}: truncated line (no newline at end): {line[:80]!r}")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise MetricsError(f"{p}:{i}: corrupt JSON ({e.msg} at column {e.colno})") from None
        try:
            out.append(StepMetrics.model_validate(obj))
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(x) for x in first["loc"])
            raise MetricsError(f"{p}:{i}: {field}: {first['msg']}") from None
    if not out and not allow_empty:
        raise MetricsError(f"{p}: no metrics (empty file)")
    return out


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
