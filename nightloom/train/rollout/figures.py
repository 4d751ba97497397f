"""The ledger's Figures of a train.task grpo run (schema 7): the held-out prompts' mean reward at the last
evaluation with its standard error, and before the first step as `base`. Apart from gates.py, which
nightloom/gates.py imports: the ledger's records import validate."""

from __future__ import annotations

from collections.abc import Sequence

from nightloom.ledger.records import Figure
from nightloom.metrics import StepMetrics
from nightloom.train.rollout.gates import EVAL_REWARD, reward_before_after


def grpo_figures(steps: Sequence[StepMetrics]) -> list[Figure]:
    """[eval_reward] of a grpo run (none for other tasks, or without the held-out figures)."""
    got = reward_before_after(steps)
    if got is None:
        return []
    (base, _), (_, value, se) = got
    return [Figure(name=EVAL_REWARD, value=value, stderr=se, base=base)]
