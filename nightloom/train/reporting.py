"""One step's figures, built once by the trainer and handed to every sink that subscribed: the stdout step line,
metrics.jsonl (StepMetrics), the rank's Prometheus gauges, and any tracker added later.

A sink is anything with `emit(record)` (the `StepSink` protocol); `StepReporter.add` registers one, and
`StepReporter.emit` gives each the same `StepRecord`, in the order they were added.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nightloom.metrics import StepMetrics, append_metrics
from nightloom.train.moe import imbalance
from nightloom.train.sft_batch import labels_note


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step measured: global figures (loss, tokens, the peak memory over ranks) and this rank's
    own (`local_mem_bytes`, what its Prometheus endpoint reports). The native trainer fills every figure; a None is
    one the XTuner backend's logs do not hold (nightloom.finetune.track_feed), left out of the trackers' step."""

    step: int
    total_steps: int
    loss: float
    grad_norm: float | None
    lr: float | None
    tokens: int  # ids computed over the global batch
    tokens_per_s: float | None
    label_tokens: int | None
    label_tokens_per_s: float | None
    flops: float | None
    hardware_flops: float | None
    step_time_s: float | None
    peak_mem_bytes: float | None  # max over ranks
    local_mem_bytes: int | None  # this rank's peak, read after the step's evaluation
    mfu: float | None
    hfu: float | None
    time: float
    attempt: int
    gap: bool
    world_size: int
    collective_latency_s: float | None
    eval_loss: float | None = None
    eval_ppl: float | None = None
    eval_tokens: int | None = None
    router_aux_loss: float | None = None
    expert_tokens: list[int] | None = None
    preference: dict[str, float] | None = None  # train.task dpo and grpo: TRL's names (rewards/…, reward, kl…), eval_*


class StepSink(Protocol):
    def emit(self, record: StepRecord) -> None: ...


class StepReporter:
    """Fans each step's record out to the registered sinks."""

    def __init__(self, sinks: list[StepSink] | None = None) -> None:
        self.sinks: list[StepSink] = list(sinks or [])

    def add(self, sink: StepSink) -> StepSink:
        self.sinks.append(sink)
        return sink

    def emit(self, record: StepRecord) -> None:
        for sink in self.sinks:
            sink.emit(record)


#: the figures a StepRecord and a metrics.jsonl row (StepMetrics) hold under the same name, type and meaning
SAME_FIGURES = tuple(
    "step loss grad_norm lr tokens tokens_per_s label_tokens label_tokens_per_s flops hardware_flops step_time_s "
    "mfu hfu attempt gap eval_loss eval_ppl eval_tokens".split()
)


def same_figures(src: StepRecord | StepMetrics) -> dict:
    """SAME_FIGURES of a step, to build the other record from (metrics.jsonl's row, or XTuner's StepRecord)."""
    return {name: getattr(src, name) for name in SAME_FIGURES}


def step_metrics(r: StepRecord) -> StepMetrics:
    """The metrics.jsonl row of a step."""
    experts = r.expert_tokens
    return StepMetrics(
        **same_figures(r),
        peak_mem_bytes=int(r.peak_mem_bytes),
        time=r.time,
        world_size=r.world_size,
        collective_latency_s=r.collective_latency_s,
        router_aux_loss=r.router_aux_loss,
        expert_tokens=experts,
        expert_imbalance=imbalance(experts) if experts else None,
        **{k: v for k, v in (r.preference or {}).items() if k not in StepMetrics.model_fields},
    )


def step_line(r: StepRecord) -> str:
    """The step's line on stdout (rank 0)."""
    return (
        f"step {r.step}/{r.total_steps} loss {r.loss:.4f} grad_norm {r.grad_norm:.3f} lr {r.lr:.2e} "
        f"tok/s {r.tokens_per_s:,.0f}{labels_note(r.tokens_per_s, r.label_tokens_per_s)} "
        f"step {r.step_time_s * 1e3:.0f} ms mfu {r.mfu:.1%} mem {r.peak_mem_bytes / 2**20:.0f} MiB"
        + (preference_note(r.preference) if r.preference else "")
    )


def preference_note(figures: dict[str, float]) -> str:
    """train.task dpo: the step line's reward accuracy and margin; grpo: the mean reward, its std and the
    completions' mean length."""
    if "rewards/accuracies" not in figures:
        return (
            f" reward {figures['reward']:.3f} std {figures['reward_std']:.3f} "
            f"len {figures['completions/mean_length']:.1f}"
        )
    return f" reward acc {figures['rewards/accuracies']:.2f} margin {figures['rewards/margins']:.4f}"


class MetricsFileSink:
    """Appends each step's StepMetrics line to metrics.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def emit(self, record: StepRecord) -> None:
        append_metrics(self.path, step_metrics(record))


class StdoutSink:
    """Prints the step line, flushed."""

    def emit(self, record: StepRecord) -> None:
        print(step_line(record), flush=True)


class PromSink:
    """Sets the rank's Prometheus gauges (nightloom.train.prom.RankMetrics), experts' load for MoE."""

    def __init__(self, prom) -> None:
        self.prom = prom

    def emit(self, r: StepRecord) -> None:
        self.prom.update(
            step=r.step,
            loss=r.loss,
            grad_norm=r.grad_norm,
            tokens_per_s=r.tokens_per_s,
            step_time_s=r.step_time_s,
            mfu=r.mfu,
            memory_bytes=r.local_mem_bytes,
            collective_latency_s=r.collective_latency_s,
            eval_loss=r.eval_loss,
            eval_ppl=r.eval_ppl,
        )
        if r.expert_tokens:
            self.prom.experts(r.expert_tokens, r.router_aux_loss)
        if r.preference:
            self.prom.preference(r.preference)
