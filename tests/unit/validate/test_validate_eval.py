"""The held-out gates: eval loss must fall, and must not rise more than eval_max_rise above its best."""

from __future__ import annotations

import math

from nightloom.gates import check_eval, validate_run
from nightloom.metrics import StepMetrics
from nightloom.spec import ValidateSpec


def steps(evals: dict[int, float], n: int = 20) -> list[StepMetrics]:
    return [StepMetrics(step=s, loss=5.0 - 0.1 * s, grad_norm=1.0, eval_loss=evals.get(s)) for s in range(1, n + 1)]


def by_name(vs):
    return {v.name: v for v in vs}


def test_falling_eval_passes_both_gates():
    vs = by_name(check_eval(steps({1: 5.0, 10: 4.0, 20: 3.5}), ValidateSpec(eval_every=10)))
    assert vs["eval_falls"].passed and vs["eval_falls"].measured == 3.5 and vs["eval_falls"].threshold == 5.0
    assert vs["eval_overfit"].passed


def test_eval_that_does_not_fall_fails_naming_the_step():
    v = by_name(check_eval(steps({1: 4.0, 10: 4.0, 20: 4.1}), ValidateSpec(eval_every=10)))["eval_falls"]
    assert not v.passed and v.step == 20 and "did not fall" in v.reason


def test_overfitting_fails_when_last_rises_above_best():
    spec = ValidateSpec(eval_every=5, eval_max_rise=0.05)
    vs = by_name(check_eval(steps({1: 5.0, 5: 3.0, 10: 3.1, 15: 3.3}), spec))
    assert vs["eval_falls"].passed  # 3.3 < 5.0
    o = vs["eval_overfit"]
    assert not o.passed and math.isclose(o.threshold, 3.15) and o.step == 15 and "best 3.0000 (step 5)" in o.reason
    assert by_name(check_eval(steps({1: 5.0, 5: 3.0, 10: 3.1}), spec))["eval_overfit"].passed


def test_missing_or_nan_eval_fails():
    assert not check_eval(steps({}), ValidateSpec(eval_every=5))[0].passed
    v = check_eval(steps({1: 5.0, 5: float("nan")}), ValidateSpec(eval_every=5))[0]
    assert not v.passed and v.step == 5


def test_gate_only_when_eval_is_configured():
    names = [v.name for v in validate_run(steps({1: 5.0, 20: 4.0}), ValidateSpec())]
    assert "eval_falls" not in names
    names = [v.name for v in validate_run(steps({1: 5.0, 20: 4.0}), ValidateSpec(eval_every=10))]
    assert names[-2:] == ["eval_falls", "eval_overfit"]
