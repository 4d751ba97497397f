"""The GRPO gate validate.min_reward_gain on a run's metrics: the held-out prompts' mean reward (`eval_reward` in
metrics.jsonl) at the last evaluation minus before the first step (`start_eval_reward`) is at least the threshold;
the reason gives both with their standard errors. Pure (no torch); nightloom/gates.py makes it a Verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence

from nightloom.metrics import StepMetrics
from nightloom.train.preference.gates import GateOutcome, figure

EVAL_REWARD = "eval_reward"
START = "start_" + EVAL_REWARD


def reward_before_after(steps: Sequence[StepMetrics]) -> tuple[tuple[float, float], tuple[int, float, float]] | None:
    """((mean, SE) before the first step, (step, mean, SE) at the last evaluation), or None when either is
    missing (a resumed run's first attempt's row carries the start figures)."""
    start = next((m for m in steps if figure(m, START) is not None), None)
    evals = [m for m in steps if figure(m, EVAL_REWARD) is not None]
    if start is None or not evals:
        return None
    last = evals[-1]
    before = (figure(start, START), figure(start, START + "_se") or 0.0)
    return before, (last.step, figure(last, EVAL_REWARD), figure(last, EVAL_REWARD + "_se") or 0.0)


def reward_gain(steps: Sequence[StepMetrics], threshold: float) -> GateOutcome:
    """The held-out mean reward's gain over the run against `threshold`."""
    got = reward_before_after(steps)
    if got is None:
        reason = "validate.min_reward_gain is set but no step recorded the held-out mean reward before and after"
        return GateOutcome(False, None, threshold, reason + " (train.task grpo with validate.eval_every)")
    (b, b_se), (step, a, a_se) = got
    gain = a - b
    ok = math.isfinite(gain) and gain >= threshold
    se = math.hypot(a_se, b_se)
    reason = (
        f"held-out mean reward {b:.3f} ± {b_se:.3f} before step 1 -> {a:.3f} ± {a_se:.3f} at step {step}: gain "
        f"{gain:+.3f} ({gain / se if se else math.inf:.1f} SE) {'>=' if ok else '<'} {threshold:g}"
    )
    return GateOutcome(ok, gain, threshold, reason, None if ok else step)
