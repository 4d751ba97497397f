"""validate.min_reward_gain (train.task grpo): the held-out mean reward after minus before the first step against the
threshold, with the standard errors in the reason; a grpo run's loss gates are skipped (a policy-gradient surrogate)
and its ledger figure is the held-out mean reward with its SE and the value before training as base."""

from __future__ import annotations

import pytest

from nightloom.gates import validate_run
from nightloom.metrics import StepMetrics
from nightloom.spec import ValidateSpec
from nightloom.train.rollout.figures import grpo_figures
from nightloom.train.rollout.gates import reward_gain


def _steps(after: float, loss: float = 0.0) -> list[StepMetrics]:
    first = {"start_eval_reward": 0.1, "start_eval_reward_se": 0.03, "eval_reward": 0.12, "eval_reward_se": 0.03}
    rows = [StepMetrics(step=1, loss=loss, grad_norm=1.0, **first)]
    rows += [StepMetrics(step=s, loss=loss + 0.01 * s, grad_norm=1.0) for s in (2, 3)]
    rows.append(StepMetrics(step=4, loss=loss, grad_norm=1.0, eval_reward=after, eval_reward_se=0.04))
    return rows


def test_the_gain_is_measured_from_before_step_1_to_the_last_evaluation():
    ok = reward_gain(_steps(0.5), 0.2)
    assert ok.passed and ok.measured == pytest.approx(0.4)
    assert "0.100 ± 0.030 before step 1 -> 0.500 ± 0.040 at step 4: gain +0.400 (8.0 SE) >= 0.2" in ok.reason
    low = reward_gain(_steps(0.2), 0.2)
    assert not low.passed and low.step == 4 and "< 0.2" in low.reason
    none = reward_gain([StepMetrics(step=1, loss=1.0)], 0.2)
    assert not none.passed and none.measured is None and "validate.eval_every" in none.reason


def test_a_grpo_run_is_judged_on_its_reward_not_its_loss():
    spec = ValidateSpec(min_reward_gain=0.2, eval_every=2, min_loss_drop=0.05)
    grpo = {v.name: v for v in validate_run(_steps(0.5), spec, task="grpo")}
    assert grpo["loss_drop"].skipped and grpo["reward_gain"].passed and "eval_falls" not in grpo
    other = {v.name: v for v in validate_run(_steps(0.5), spec)}  # the same rows as a pretraining run's
    assert not other["loss_drop"].passed and not other["eval_falls"].passed


def test_the_ledger_figure_is_the_held_out_reward_with_its_base():
    (f,) = grpo_figures(_steps(0.5))
    assert (f.name, f.value, f.stderr, f.base) == ("eval_reward", 0.5, 0.04, 0.1)
    assert grpo_figures([StepMetrics(step=1, loss=1.0)]) == []
