"""Validation gates: each passes on a healthy run and fails, with its reason, on a crafted bad one."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest

from nightloom.catalog import get_model
from nightloom.gates import (
    MfuInputs,
    Peak,
    PeakError,
    ValidationFailed,
    check_finite,
    check_golden,
    check_grad_norm,
    check_loss_drop,
    check_mfu,
    check_spikes,
    gated,
    load_golden,
    measure_mfu,
    mfu_inputs,
    require_passed,
    resolve_peak,
    theil_sen,
    validate_run,
    verdict_label,
)
from nightloom.metrics import MetricsError, StepMetrics, append_metrics, read_metrics
from nightloom.perf import PeakMeasurement, flops_per_token, mfu
from nightloom.spec import GoldenSpec, ValidateSpec


def healthy(n: int = 60, seed: int = 0, tps: float = 1000.0) -> list[StepMetrics]:
    """A learning run: exponential decay to a floor plus small noise; steady throughput after step 0."""
    rng = random.Random(seed)
    out = []
    for s in range(1, n + 1):
        loss = 2.0 + 3.0 * math.exp(-s / 15) + rng.gauss(0, 0.01)
        rate = (tps / 3 if s == 1 else tps) * (1 + rng.gauss(0, 0.01))
        out.append(
            StepMetrics(
                step=s,
                loss=loss,
                grad_norm=1.0 + rng.random() * 0.2,
                tokens=1024,
                tokens_per_s=rate,
                step_time_s=1024 / rate,
            )
        )
    return out


def with_loss(steps: list[StepMetrics], k: int, loss: float, **kw) -> list[StepMetrics]:
    return [m.model_copy(update=dict(loss=loss, **kw)) if m.step == k else m for m in steps]


SHAPE = get_model("tiny")
FPT = flops_per_token(SHAPE, 128)
HFPT = flops_per_token(SHAPE, 128, recompute="full", hardware=True)
PEAK = Peak(flops=FPT * 1000 / 0.40, precision="fp32", source="measured: test")  # healthy run ⇒ MFU ≈ 40%


def inputs(predicted: float | None = 0.45, n_devices: int = 1) -> MfuInputs:
    got = mfu_inputs(SHAPE, 128, "full", n_devices, PEAK, predicted)
    assert got == MfuInputs(FPT, HFPT, n_devices, PEAK, predicted)
    return got


# ---------------------------------------------------------------------------------------------- MFU


def test_mfu_gate_passes_healthy_and_reports_hfu_with_peak_source():
    vs = {v.name: v for v in check_mfu(healthy(), ValidateSpec(mfu_floor=0.3, mfu_vs_plan=0.8), inputs())}
    assert vs["mfu_floor"].passed and vs["mfu_vs_plan"].passed
    assert vs["mfu_floor"].measured == pytest.approx(0.40, rel=0.02)
    # the one formula from nightloom.perf, applied to the median steady-state rate
    assert vs["mfu_floor"].measured == pytest.approx(mfu(1000.0, FPT, 1, PEAK.flops), rel=0.02)
    assert vs["mfu_vs_plan"].threshold == pytest.approx(0.8 * 0.45)
    assert vs["hfu"].measured > vs["mfu_floor"].measured  # recomputation counted
    for v in vs.values():
        assert v.precision == "fp32" and v.peak_source == "measured: test"


def test_mfu_warmup_and_resume_steps_do_not_count():
    steps = healthy()
    slow = [m.model_copy(update={"tokens_per_s": 10.0, "gap": True}) if m.step % 7 == 0 else m for m in steps]
    a, b = measure_mfu(steps, inputs()), measure_mfu(slow, inputs())
    assert b.mfu == pytest.approx(a.mfu, rel=0.02)
    assert b.steps_used < a.steps_used


def test_mfu_counts_each_step_against_the_devices_that_ran_it():
    """A recovery shrank 4 devices to 2 after step 40 and per-device speed stayed the same: MFU is unchanged,
    not doubled for the steps that ran on 4 (dividing everything by the final 2 would report ~2× for them)."""
    four = [
        m.model_copy(update={"tokens_per_s": 4000.0 * (1 + (m.step % 3) * 1e-3), "world_size": 4})
        for m in healthy()[:40]
    ]
    two = [
        m.model_copy(update={"tokens_per_s": 2000.0 * (1 + (m.step % 3) * 1e-3), "world_size": 2})
        for m in healthy()[40:]
    ]
    got = measure_mfu(four + two, inputs(n_devices=2))
    assert got.mfu == pytest.approx(0.40, rel=0.01)
    legacy = [m.model_copy(update={"world_size": None}) for m in four + two]  # no per-step size recorded
    assert measure_mfu(legacy, inputs(n_devices=2)).mfu > 0.55


def test_lora_counts_no_weight_gradients_for_the_frozen_base():
    """LoRA: 4N + attention per token instead of 6N + attention (Kaplan et al. 2020's 2N fwd + 4N bwd split)."""
    from nightloom.perf import count_params

    n = count_params(SHAPE, include_embeddings=False)
    attn = 12 * SHAPE.layers * SHAPE.heads * SHAPE.head_dim * 128
    assert flops_per_token(SHAPE, 128) == 6 * n + attn
    assert flops_per_token(SHAPE, 128, frozen_base=True) == 4 * n + attn
    lora = mfu_inputs(SHAPE, 128, "full", 1, PEAK, frozen_base=True)
    assert lora.flops_per_token == 4 * n + attn and lora.hardware_flops_per_token == 6 * n + attn + attn / 3
    # the same throughput is less work under LoRA, so a lower MFU
    assert measure_mfu(healthy(), lora).mfu < measure_mfu(healthy(), inputs()).mfu


def test_mfu_below_floor_fails_with_reason():
    vs = {v.name: v for v in check_mfu(healthy(tps=500), ValidateSpec(mfu_floor=0.3), inputs())}
    v = vs["mfu_floor"]
    assert not v.passed and v.measured == pytest.approx(0.20, rel=0.03)
    assert "< floor 30.00%" in v.reason and "measured: test" in v.reason


def test_mfu_below_plan_fraction_fails():
    v = {v.name: v for v in check_mfu(healthy(), ValidateSpec(mfu_vs_plan=0.9), inputs(predicted=0.6))}["mfu_vs_plan"]
    assert not v.passed and v.threshold == pytest.approx(0.54)
    assert "0.9 × predicted 60.00%" in v.reason


def test_mfu_vs_plan_without_prediction_is_an_error_not_a_pass():
    v = {v.name: v for v in check_mfu(healthy(), ValidateSpec(mfu_vs_plan=0.5), inputs(predicted=None))}["mfu_vs_plan"]
    assert not v.passed and "predicted no MFU" in v.reason


def test_mfu_over_100_percent_fails_even_without_floor():
    v = check_mfu(healthy(tps=5000), ValidateSpec(), inputs())[0]
    assert not v.passed and "exceeds 100%" in v.reason


def test_mfu_without_throughput_fails_when_floor_set():
    steps = [StepMetrics(step=s, loss=3.0 - s * 0.1) for s in range(1, 10)]
    v = check_mfu(steps, ValidateSpec(mfu_floor=0.1), inputs())[0]
    assert not v.passed and "no throughput" in v.reason


def test_peak_resolution_never_defaults():
    p = resolve_peak("h100-80gb", "auto")
    assert p.precision == "bf16" and p.flops == 989e12 and "datasheet" in p.source
    assert resolve_peak("a100-80gb", "fp32").flops == 19.5e12
    with pytest.raises(PeakError, match="no peak FLOP/s for GPU type 'mi300x'"):
        resolve_peak("mi300x", "bf16")
    with pytest.raises(PeakError, match="no measured peak"):
        resolve_peak("cpu", "auto")
    m = PeakMeasurement(1e10, "fp32", "measured: torch.mm")
    assert resolve_peak("cpu", "auto", m) == Peak(1e10, "fp32", "measured: torch.mm")
    with pytest.raises(PeakError, match="no peak/FLOPs"):
        validate_run(healthy(), ValidateSpec(mfu_floor=0.1), mfu_inputs=None)


# ---------------------------------------------------------------------------------------------- convergence


def test_all_gates_pass_on_a_healthy_run(tmp_path: Path):
    golden = healthy(seed=1)
    spec = ValidateSpec(mfu_floor=0.3, mfu_vs_plan=0.8, grad_norm_max=5.0, golden=GoldenSpec(rtol=0.05))
    vs = validate_run(healthy(), spec, inputs(), golden=golden)
    assert [v.name for v in vs] == [
        "mfu_floor",
        "mfu_vs_plan",
        "hfu",
        "finite",
        "loss_drop",
        "spikes",
        "grad_norm",
        "golden",
    ]
    assert all(v.passed for v in vs), [v.reason for v in vs if not v.passed]
    require_passed(vs)
    # the same gates on a run that is not the golden curve's: only golden fails
    far = [m.model_copy(update={"loss": m.loss * 1.2}) for m in healthy()]
    assert [v.name for v in validate_run(far, spec, inputs(), golden=golden) if not v.passed] == ["golden"]


def test_parity_setting_was_removed_with_a_clear_error():
    """validate.parity never ran (a run trains one layout): a spec that sets it is refused, naming the field."""
    from nightloom.spec import SpecError
    from nightloom.spec.load import parse_spec

    with pytest.raises(SpecError, match=r"validate.*`parity` was removed.*test_parity.py.*validate.golden"):
        parse_spec({"name": "x", "dataset": {"path": "/d"}, "validate": {"parity": {"enabled": True}}})
    assert "parity" not in ValidateSpec.model_fields


def test_skipped_gates_print_skip_or_not_gated_never_pass():
    """A gate that did not run is not a pass: SKIP when nothing was measured, "not gated" for a reported figure
    (MFU with no floor, HFU); only a gate that ran and held says "pass"."""
    vs = {v.name: v for v in validate_run(healthy(), ValidateSpec(), inputs())}
    assert vs["mfu_floor"].skipped and vs["mfu_floor"].label == "not gated"
    assert vs["mfu_vs_plan"].label == "not gated" and vs["hfu"].label == "not gated"
    assert vs["grad_norm"].label == "SKIP"
    assert vs["loss_drop"].label == "pass" and vs["finite"].label == "pass"
    assert {v.label for v in vs.values() if v.skipped} <= {"SKIP", "not gated"}
    assert verdict_label(vs["mfu_floor"].model_dump()) == "not gated"
    floor = {v.name: v for v in validate_run(healthy(), ValidateSpec(mfu_floor=0.3), inputs())}["mfu_floor"]
    assert floor.label == "pass" and not floor.skipped
    low = {v.name: v for v in validate_run(healthy(tps=500), ValidateSpec(mfu_floor=0.3), inputs())}["mfu_floor"]
    assert low.label == "FAIL"
    assert [v.name for v in gated(list(vs.values()))] == ["finite", "loss_drop", "spikes"]


def test_nan_at_step_k_fails_and_names_the_step():
    steps = with_loss(healthy(), 23, float("nan"))
    v = check_finite(steps)
    assert not v.passed and v.step == 23 and "loss is nan at step 23" in v.reason
    vs = validate_run(steps, ValidateSpec())
    with pytest.raises(ValidationFailed, match="finite: loss is nan at step 23"):
        require_passed(vs)


def test_inf_grad_norm_fails():
    steps = [m.model_copy(update={"grad_norm": math.inf}) if m.step == 9 else m for m in healthy()]
    v = check_finite(steps)
    assert not v.passed and "grad_norm is inf at step 9" in v.reason


def test_flat_loss_fails_loss_drop():
    rng = random.Random(3)
    flat = [StepMetrics(step=s, loss=3.0 + rng.gauss(0, 0.02)) for s in range(1, 61)]
    v = check_loss_drop(flat, 0.05)
    assert not v.passed and "not learning" in v.reason and v.measured < 0.05


def test_loss_drop_uses_a_trend_not_first_vs_last():
    # first-vs-last would say 40% drop (a lucky low last step and high first step); the trend is flat
    rng = random.Random(4)
    flat = [StepMetrics(step=s, loss=3.0 + rng.gauss(0, 0.02)) for s in range(1, 41)]
    flat[0] = flat[0].model_copy(update={"loss": 5.0})
    flat[-1] = flat[-1].model_copy(update={"loss": 3.0})
    assert (flat[0].loss - flat[-1].loss) / flat[0].loss > 0.3
    assert not check_loss_drop(flat, 0.05).passed
    # and a noisy but learning curve passes
    assert check_loss_drop(healthy(), 0.05).passed


def test_too_few_losses_fail_a_finished_run_but_skip_one_stopped_at_a_window_end():
    """A night that made 1-2 steps before its window closed cannot say whether the model learns: the verdict is
    skipped (the run continues and is judged on the whole curve), never passed as judged, never a failure that
    would end the run. A finished run with too few steps still fails."""
    two = healthy(2)
    done = check_loss_drop(two, 0.05)
    assert not done.passed and not done.skipped and "a trend needs at least 3" in done.reason
    early = check_loss_drop(two, 0.05, stopped_early=True)
    assert early.passed and early.skipped and "stopped early" in early.reason
    vs = {v.name: v for v in validate_run(two, ValidateSpec(), stopped_early=True)}
    assert vs["loss_drop"].skipped and all(v.passed for v in vs.values())
    assert not {v.name: v for v in validate_run(two, ValidateSpec())}["loss_drop"].passed
    assert check_loss_drop(healthy(), 0.05, stopped_early=True).passed  # enough points: judged as usual
    assert not check_loss_drop(healthy(), 0.99, stopped_early=True).passed


def test_no_step_before_a_window_end_is_one_skipped_verdict_and_a_finished_run_without_steps_is_an_error():
    (v,) = validate_run([], ValidateSpec(mfu_floor=0.3), stopped_early=True)
    assert v.name == "steps" and v.passed and v.skipped and "before step 1" in v.reason
    with pytest.raises(ValueError, match="no metrics steps"):
        validate_run([], ValidateSpec())


def test_loss_drop_window_looks_only_at_the_last_steps():
    steps = healthy(120)
    assert check_loss_drop(steps, 0.2).passed
    v = check_loss_drop(steps, 0.2, window=30)  # the tail has converged
    assert not v.passed and "steps 91–120" in v.reason


def test_theil_sen_ignores_an_outlier():
    xs = list(range(20))
    ys = [2.0 * x + 1 for x in xs]
    ys[5] = 1000.0
    slope, icpt = theil_sen(xs, ys)
    assert slope == pytest.approx(2.0) and icpt == pytest.approx(1.0)


def test_spike_fails_with_step_and_factor():
    steps = healthy()
    bad = with_loss(steps, 40, steps[39].loss + 0.8)
    assert check_spikes(steps, 8.0).passed
    v = check_spikes(bad, 8.0)
    assert not v.passed and v.step == 40 and "loss spike at step 40" in v.reason and v.measured > 8


def test_resume_gap_is_not_a_spike():
    steps = healthy()
    resumed = with_loss(steps, 40, steps[39].loss + 0.8, gap=True)
    v = check_spikes(resumed, 8.0)
    assert v.passed, v.reason
    assert all(x.passed for x in validate_run(resumed, ValidateSpec()))


def test_early_steep_descent_is_not_a_spike():
    steep = [StepMetrics(step=s, loss=0.5 + 5 * math.exp(-s / 3)) for s in range(1, 40)]
    assert check_spikes(steep, 8.0).passed


def test_grad_norm_bound():
    steps = healthy()
    assert check_grad_norm(steps, 5.0).passed
    assert check_grad_norm(steps, None).skipped
    bad = [m.model_copy(update={"grad_norm": 42.0}) if m.step == 17 else m for m in steps]
    v = check_grad_norm(bad, 5.0)
    assert not v.passed and v.step == 17 and "42 at step 17 > 5" in v.reason
    v = check_grad_norm([StepMetrics(step=1, loss=1.0)], 5.0)
    assert not v.passed and "no step recorded grad_norm" in v.reason


def test_diverging_golden_curve_fails(tmp_path: Path):
    gpath = tmp_path / "golden.jsonl"
    for m in healthy(seed=1):
        append_metrics(gpath, StepMetrics(step=m.step, loss=m.loss))
    golden = load_golden(gpath)
    assert check_golden(healthy(), golden, 0.05).passed
    diverging = [m.model_copy(update={"loss": m.loss * (1 + 0.004 * m.step)}) for m in healthy()]
    v = check_golden(diverging, golden, 0.05, source=str(gpath))
    assert not v.passed and v.measured > 0.05 and str(gpath) in v.reason
    assert v.step is not None and v.step > 10
    v = check_golden(healthy(), [StepMetrics(step=1000, loss=1.0)], 0.05)
    assert not v.passed and "no step in common" in v.reason


def test_golden_configured_but_missing_fails():
    vs = {v.name: v for v in validate_run(healthy(), ValidateSpec(golden=GoldenSpec(path="/x.jsonl")))}
    assert not vs["golden"].passed


# ---------------------------------------------------------------------------------------------- bad files


def test_missing_truncated_corrupt_metrics_files(tmp_path: Path):
    with pytest.raises(MetricsError, match="metrics file not found"):
        load_golden(tmp_path / "nope.jsonl")
    good = '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.9}\n'
    p = tmp_path / "trunc.jsonl"
    p.write_text(good + '{"step": 3, "lo')
    with pytest.raises(MetricsError, match=rf"{p}:3: truncated line"):
        read_metrics(p)
    p = tmp_path / "corrupt.jsonl"
    p.write_text(good + "{not json}\n" + good)
    with pytest.raises(MetricsError, match=rf"{p}:3: corrupt JSON"):
        read_metrics(p)
    p = tmp_path / "badfield.jsonl"
    p.write_text(good + '{"step": "x", "loss": 1}\n')
    with pytest.raises(MetricsError, match=rf"{p}:3: step:"):
        read_metrics(p)
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    with pytest.raises(MetricsError, match="empty file"):
        read_metrics(p)


def test_golden_from_file_and_from_the_ledger(tmp_path: Path):
    from datetime import UTC, datetime

    from nightloom.gates import resolve_golden
    from nightloom.ledger import Ledger

    assert resolve_golden(GoldenSpec()) is None
    lg = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    spec = ValidateSpec(golden=GoldenSpec(from_ledger=True, rtol=0.05))
    first = resolve_golden(spec.golden, lg, "h1")  # the first run of a spec: nothing to compare with yet
    assert first.steps is None
    v = {v.name: v for v in validate_run(healthy(), spec, golden=first)}["golden"]
    assert v.passed and v.skipped and "no verified ledger run" in v.reason
    mpath = tmp_path / "run1" / "metrics.jsonl"
    for m in healthy(seed=1):
        append_metrics(mpath, m)
    lg.start_run(
        run_id="run1",
        spec_hash="h1",
        name="n",
        model="tiny",
        cluster="c",
        provider="local",
        gpu_type="cpu",
        world_size=2,
        metrics_path=str(mpath),
        started_at=datetime.now(UTC),
    )
    lg.finish_run("run1", status="succeeded", tokens_per_s=1.0, verdicts=validate_run(healthy(seed=1), ValidateSpec()))
    g = resolve_golden(spec.golden, lg, "h1")
    assert len(g.steps) == 60 and "ledger run run1" in g.source
    assert {v.name: v for v in validate_run(healthy(), spec, golden=g)}["golden"].passed
    drifting = [m.model_copy(update={"loss": m.loss * 1.2}) for m in healthy()]
    v = {v.name: v for v in validate_run(drifting, spec, golden=g)}["golden"]
    assert not v.passed and "ledger run run1" in v.reason
    lg.close()
    gpath = tmp_path / "g.jsonl"
    gpath.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss"')
    with pytest.raises(MetricsError, match=rf"{gpath}:2: truncated"):
        resolve_golden(GoldenSpec(path=str(gpath)))


def test_hard_batches_are_not_spikes_but_a_jump_is():
    """Per-batch losses of a mixed corpus are heavy-tailed: a +15% batch passes, a +60% jump fails."""
    import random

    from nightloom.gates import check_spikes
    from nightloom.metrics import StepMetrics

    rng = random.Random(0)
    losses = [3.3 + rng.gauss(0, 0.01) for _ in range(200)]
    for i in range(20, 200, 37):
        losses[i] *= 1.15  # a hard batch, 20+ × MAD above its neighbours
    steps = [StepMetrics(step=i + 1, loss=x) for i, x in enumerate(losses)]
    assert check_spikes(steps, 8.0, min_rise=0.25).passed
    assert not check_spikes(steps, 8.0, min_rise=0.0).passed  # the MAD rule alone would flag it
    losses[150] *= 1.6
    bad = check_spikes([StepMetrics(step=i + 1, loss=x) for i, x in enumerate(losses)], 8.0, min_rise=0.25)
    assert not bad.passed and bad.step == 151 and "spike at step 151" in bad.reason
    # two hard batches in a row are not an instability when the rise must hold for 3 steps; 4 steps up are
    losses[151] *= 1.6
    steps = [StepMetrics(step=i + 1, loss=x) for i, x in enumerate(losses)]
    assert check_spikes(steps, 8.0, min_rise=0.25, sustain=3).passed
    losses[152] *= 1.6
    losses[153] *= 1.6
    steps = [StepMetrics(step=i + 1, loss=x) for i, x in enumerate(losses)]
    v = check_spikes(steps, 8.0, min_rise=0.25, sustain=3)
    assert not v.passed and v.step == 151


def test_mfu_over_100_percent_of_a_busy_cpus_measured_peak_is_not_a_failure():
    """A CPU peak is one thread's matmul timed at the run's start; a host busy then (a resumed night beside other
    work) measures it low and the run's MFU comes out above 100%: reported, not failed. A datasheet peak fails."""
    from nightloom.perf import Peak

    busy = dataclasses.replace(inputs(), peak=Peak(1e9, "fp32", "measured: torch.mm 1024 fp32, 1 thread"))
    v = check_mfu(healthy(tps=5000), ValidateSpec(), busy)[0]
    assert v.passed and v.measured > 1 and "CPU peak measured at the start" in v.reason
    assert not check_mfu(healthy(tps=5000), ValidateSpec(), inputs())[0].passed


def test_a_compared_verdict_names_the_step_only_when_it_failed():
    """The gates that compare a figure with a threshold (grad_norm, spikes, eval, golden) share one rule."""
    from nightloom.gates import Verdict

    ok = Verdict.compared("grad_norm", True, 1.0, 5.0, 17, "fine")
    bad = Verdict.compared("grad_norm", False, 42.0, 5.0, 17, "too big")
    assert (ok.passed, ok.step, ok.measured, ok.threshold) == (True, None, 1.0, 5.0)
    assert (bad.passed, bad.step, bad.label, bad.reason) == (False, 17, "FAIL", "too big")
