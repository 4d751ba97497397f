"""The preference gate validate.min_reward_accuracy on a run's metrics: the last held-out reward accuracy (the
share of held-out pairs whose chosen earns the higher reward, `eval_rewards/accuracies` in metrics.jsonl) is at
least the threshold. Pure (no torch); nightloom/gates.py turns the outcome into its Verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nightloom.metrics import StepMetrics

EVAL_ACCURACY = "eval_rewards/accuracies"


@dataclass(frozen=True)
class GateOutcome:
    passed: bool
    measured: float | None
    threshold: float
    reason: str
    step: int | None = None


def figure(m: StepMetrics, name: str) -> float | None:
    """A preference figure (TRL's name) of a step's metrics row, or None."""
    v = (m.model_extra or {}).get(name)
    return float(v) if v is not None else None


def reward_accuracy(steps: Sequence[StepMetrics], threshold: float) -> GateOutcome:
    """The last evaluation's held-out reward accuracy against `threshold`."""
    evals = [(m.step, figure(m, EVAL_ACCURACY)) for m in steps if figure(m, EVAL_ACCURACY) is not None]
    if not evals:
        reason = "validate.min_reward_accuracy is set but no step recorded a held-out reward accuracy"
        return GateOutcome(False, None, threshold, reason + " (train.task dpo with validate.eval_every)")
    step, acc = evals[-1]
    ok = math.isfinite(acc) and acc >= threshold
    first = evals[0][1]
    reason = f"held-out reward accuracy {first:.3f} at step {evals[0][0]} -> {acc:.3f} at step {step}"
    return GateOutcome(ok, acc, threshold, f"{reason} {'>=' if ok else '<'} {threshold:g}", None if ok else step)
