"""The ledger's Figures of a train.task dpo run (schema 7): the last held-out evaluation's reward accuracy, margin
and DPO loss under TRL's names, each with its value before the first step as `base`. Apart from gates.py, which
nightloom/gates.py imports: the ledger's records import validate."""

from __future__ import annotations

from collections.abc import Sequence

from nightloom.ledger.records import Figure
from nightloom.metrics import StepMetrics
from nightloom.train.preference.gates import EVAL_ACCURACY, figure

#: the ledger's figures of a dpo run: the last held-out evaluation's (TRL's names), `base` the same before step 1
LEDGER_FIGURES = ("eval_rewards/accuracies", "eval_rewards/margins", "eval_loss")


def preference_figures(steps: Sequence[StepMetrics]) -> list[Figure]:
    """The ledger's Figures of a train.task dpo run (none for other tasks): the final held-out reward accuracy,
    margin and DPO loss, each with its value before training as `base`."""
    evals = [m for m in steps if figure(m, EVAL_ACCURACY) is not None]
    if not evals:
        return []
    start = next((m for m in steps if figure(m, "start_" + EVAL_ACCURACY) is not None), None)
    out = []
    for name in LEDGER_FIGURES:
        value = evals[-1].eval_loss if name == "eval_loss" else figure(evals[-1], name)
        if value is not None:
            out.append(Figure(name=name, value=value, base=figure(start, "start_" + name) if start else None))
    return out
