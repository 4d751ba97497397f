"""The run's gates: MFU and convergence checks over per-step metrics, one typed Verdict per gate.

A run is trusted only if it used the hardware (MFU, computed with the one PaLM formula in nightloom/perf.py
against a peak whose source is recorded) and it is learning (a robust fitted loss trend falls, no NaN/Inf,
no spikes, bounded grad norms, and, when configured, agreement with a golden curve or a reference layout).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from nightloom.metrics import StepMetrics, read_metrics
from nightloom.perf import (  # noqa: F401 - Peak, PeakError and the resolvers are imported from here too
    Peak,
    PeakError,
    PeakMeasurement,
    flops_per_token,
    mfu,
    resolve_peak,
    resolve_precision,
)
from nightloom.records import FrozenRecord
from nightloom.shape import ModelShape
from nightloom.spec import GoldenSpec, ValidateSpec
from nightloom.train.preference.gates import reward_accuracy
from nightloom.train.rollout.gates import reward_gain


class ValidationFailed(RuntimeError):
    """One or more gates failed; the message lists each failing gate's reason."""

    def __init__(self, failed: list[Verdict]):
        self.failed = failed
        super().__init__("validation failed:\n  " + "\n  ".join(f"{v.name}: {v.reason}" for v in failed))


class Verdict(FrozenRecord):
    """The outcome of one gate: what was measured, against which threshold, and why it passed or failed."""

    name: str
    passed: bool
    measured: float | None = None
    threshold: float | None = None
    reason: str
    skipped: bool = False  # the gate was not configured; `passed` is True
    step: int | None = None  # the first offending step, when one exists
    precision: str | None = None  # MFU figures: the precision of the peak
    peak_source: str | None = None  # MFU figures: datasheet entry or measurement

    @classmethod
    def compared(cls, name: str, ok: bool, measured: float, threshold: float, step: int | None, reason: str):
        """A gate that compared a measured figure with its threshold; the offending `step` is kept when it failed."""
        return cls(
            name=name, passed=ok, measured=measured, threshold=threshold, step=None if ok else step, reason=reason
        )

    @property
    def label(self) -> str:
        """What to print for this verdict: "pass", "FAIL", or, for a gate that did not run, "SKIP" (nothing
        measured) or "not gated" (a figure was measured and reported, but no threshold judged it)."""
        if self.skipped:
            return "not gated" if self.measured is not None else "SKIP"
        return "pass" if self.passed else "FAIL"


def verdict_label(v: Verdict | dict) -> str:
    """Verdict.label for a verdict or its model_dump() (the run summary keeps verdicts as dicts)."""
    return (v if isinstance(v, Verdict) else Verdict.model_validate(v)).label


def gated(verdicts: Sequence[Verdict]) -> list[Verdict]:
    """The verdicts of gates that ran (not skipped): a run is verified only if at least one did."""
    return [v for v in verdicts if not v.skipped]


@dataclass(frozen=True)
class MfuInputs:
    """What the MFU gate needs besides the metrics: FLOPs per token (model and hardware), devices, the peak."""

    flops_per_token: float
    hardware_flops_per_token: float
    n_devices: int
    peak: Peak
    predicted_mfu: float | None = None  # the planner's prediction, when it made one


def mfu_inputs(
    shape: ModelShape,
    seq_len: int,
    recompute: str,
    n_devices: int,
    peak: Peak,
    predicted_mfu: float | None = None,
    frozen_base: bool = False,
) -> MfuInputs:
    """MfuInputs from the model, the plan's recompute mode and the peak (FLOPs/token from nightloom.perf);
    frozen_base for LoRA/QLoRA, whose base weights get no gradients."""
    return MfuInputs(
        flops_per_token(shape, seq_len, frozen_base=frozen_base),
        flops_per_token(shape, seq_len, recompute, hardware=True, frozen_base=frozen_base),
        n_devices,
        peak,
        predicted_mfu,
    )


@dataclass(frozen=True)
class MfuReport:
    """Steady-state throughput and the MFU/HFU derived from it."""

    tokens_per_s: float
    mfu: float
    hfu: float
    steps_used: int
    peak: Peak


# ---------------------------------------------------------------------------------------------- helpers


def _throughput(m: StepMetrics) -> float | None:
    if m.tokens_per_s is not None and math.isfinite(m.tokens_per_s) and m.tokens_per_s > 0:
        return m.tokens_per_s
    if m.step_time_s and m.step_time_s > 0 and m.tokens > 0:
        return m.tokens / m.step_time_s
    return None


def _flops_per_token(m: StepMetrics, inputs: MfuInputs) -> tuple[float, float]:
    """(model, hardware) FLOPs per computed token of a step: the trainer's own count of what it computed when the
    metrics carry it (unpacked sft micro-batches are as wide as their longest row, not seq_len), else inputs'."""
    if m.flops and m.hardware_flops and m.tokens > 0:
        return m.flops / m.tokens, m.hardware_flops / m.tokens
    return inputs.flops_per_token, inputs.hardware_flops_per_token


def steady_state(steps: Sequence[StepMetrics], warmup: int | None = None) -> list[StepMetrics]:
    """Steps that measure steady throughput: drop warm-up (default 10%, at least 1) and first-after-resume steps."""
    if warmup is None:
        warmup = max(1, len(steps) // 10) if len(steps) > 1 else 0
    return [m for m in steps[warmup:] if not m.gap]


def measure_mfu(steps: Sequence[StepMetrics], inputs: MfuInputs, warmup: int | None = None) -> MfuReport | None:
    """Median steady-state tokens/s → MFU and HFU (PaLM App. B via nightloom.perf.mfu); None if no throughput.

    Each step counts against the devices that ran it (`world_size`, else inputs.n_devices): after a recovery
    shrinks the cluster, the earlier steps are not divided by the smaller count."""
    p = inputs.peak
    rated = [(r, m) for m in steady_state(steps, warmup) if (r := _throughput(m))]
    if not rated:
        return None
    per_token = [_flops_per_token(m, inputs) for _, m in rated]
    devices = [m.world_size or inputs.n_devices for _, m in rated]
    return MfuReport(
        tokens_per_s=statistics.median(r for r, _ in rated),
        mfu=statistics.median(mfu(r, f, n, p.flops) for (r, _), (f, _), n in zip(rated, per_token, devices)),
        hfu=statistics.median(mfu(r, h, n, p.flops) for (r, _), (_, h), n in zip(rated, per_token, devices)),
        steps_used=len(rated),
        peak=p,
    )


def theil_sen(xs: Sequence[float], ys: Sequence[float], max_points: int = 400) -> tuple[float, float]:
    """Robust line fit (median of pairwise slopes; Sen 1968): (slope, intercept). Subsamples long series."""
    n = len(xs)
    if n < 2:
        raise ValueError("a trend needs at least 2 points")
    if n > max_points:
        idx = [round(i * (n - 1) / (max_points - 1)) for i in range(max_points)]
        xs, ys = [xs[i] for i in idx], [ys[i] for i in idx]
        n = max_points
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n) if xs[j] != xs[i]]
    slope = statistics.median(slopes)
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys))
    return slope, intercept


def _mad(values: Sequence[float]) -> float:
    med = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - med) for v in values)  # consistent with σ for Gaussian noise


# ---------------------------------------------------------------------------------------------- MFU gates


@dataclass(frozen=True)
class _MfuCase:
    """What the MFU gates' table reads: the spec, the plan's inputs and the measured report (None: no throughput)."""

    spec: ValidateSpec
    inputs: MfuInputs
    report: MfuReport | None

    @property
    def m(self) -> float:
        return self.report.mfu

    @property
    def fig(self) -> str:
        r, p = self.report, self.inputs.peak
        return (
            f"MFU {r.mfu:.2%} ({r.tokens_per_s:,.0f} tokens/s over {r.steps_used} steps, {p.precision} peak "
            f"{p.flops:.3g} FLOP/s from {p.source})"
        )

    @property
    def plan_need(self) -> float:
        return self.spec.mfu_vs_plan * self.inputs.predicted_mfu


_NO_THROUGHPUT = "no throughput in the metrics (tokens_per_s, or tokens and step_time_s, on steady-state steps)"

#: The MFU gates, in order: for each, its rows (when, verdict fields); the first row whose `when` holds gives the
#: gate's verdict, and a row whose fields are None gives none.
_MFU_TABLE: tuple[tuple[str, tuple[tuple[Callable[[_MfuCase], bool], Callable[[_MfuCase], dict | None]], ...]], ...] = (
    (
        "mfu_floor",
        (
            (
                lambda c: c.report is None,
                lambda c: dict(
                    passed=c.spec.mfu_floor == 0,
                    skipped=c.spec.mfu_floor == 0,
                    threshold=c.spec.mfu_floor,
                    reason=_NO_THROUGHPUT,
                ),
            ),
            (
                lambda c: c.m > 1.0 and c.inputs.peak.measured_on_cpu,
                lambda c: dict(
                    passed=True,
                    skipped=c.spec.mfu_floor == 0,
                    measured=c.m,
                    threshold=c.spec.mfu_floor,
                    reason=f"{c.fig} exceeds 100% of a CPU peak measured at the start, when the host was busier (not "
                    "gated: a datasheet peak fails here)",
                ),
            ),
            (
                lambda c: c.m > 1.0,
                lambda c: dict(
                    passed=False,
                    measured=c.m,
                    threshold=1.0,
                    reason=f"{c.fig} exceeds 100%: the peak or the FLOP count is wrong",
                ),
            ),
            (
                lambda c: c.spec.mfu_floor == 0,
                lambda c: dict(passed=True, skipped=True, measured=c.m, threshold=0.0, reason=f"{c.fig}; no floor set"),
            ),
            (
                lambda c: True,
                lambda c: dict(
                    passed=c.m >= c.spec.mfu_floor,
                    measured=c.m,
                    threshold=c.spec.mfu_floor,
                    reason=f"{c.fig} {'>=' if c.m >= c.spec.mfu_floor else '<'} floor {c.spec.mfu_floor:.2%}",
                ),
            ),
        ),
    ),
    (
        "mfu_vs_plan",
        (
            (
                lambda c: c.report is None,
                lambda c: dict(passed=c.spec.mfu_vs_plan == 0, skipped=c.spec.mfu_vs_plan == 0, reason=_NO_THROUGHPUT),
            ),
            (
                lambda c: c.spec.mfu_vs_plan == 0,
                lambda c: dict(passed=True, skipped=True, measured=c.m, threshold=None, reason="mfu_vs_plan not set"),
            ),
            (
                lambda c: c.inputs.predicted_mfu is None or not c.inputs.predicted_mfu > 0,
                lambda c: dict(
                    passed=False,
                    measured=c.m,
                    reason=f"mfu_vs_plan={c.spec.mfu_vs_plan} is set but the plan predicted no MFU",
                ),
            ),
            (
                lambda c: True,
                lambda c: dict(
                    passed=c.m >= c.plan_need,
                    measured=c.m,
                    threshold=c.plan_need,
                    reason=f"{c.fig} {'>=' if c.m >= c.plan_need else '<'} {c.spec.mfu_vs_plan:g} × predicted "
                    f"{c.inputs.predicted_mfu:.2%} = {c.plan_need:.2%}",
                ),
            ),
        ),
    ),
    (
        "hfu",
        (
            (lambda c: c.report is None, lambda c: None),
            (
                lambda c: True,
                lambda c: dict(
                    passed=True,
                    skipped=True,
                    measured=c.report.hfu,
                    reason=f"HFU {c.report.hfu:.2%} (counts recomputation; reported, not gated)",
                ),
            ),
        ),
    ),
)


def check_mfu(steps: Sequence[StepMetrics], spec: ValidateSpec, inputs: MfuInputs) -> list[Verdict]:
    """`mfu_floor`, `mfu_vs_plan` and (reported, never gating) `hfu` verdicts, each the first row of its gate in
    `_MFU_TABLE` that applies; with no throughput, the first two only."""
    p = inputs.peak
    case = _MfuCase(spec, inputs, measure_mfu(steps, inputs))
    out: list[Verdict] = []
    for name, rows in _MFU_TABLE:
        fields = next(verdict(case) for when, verdict in rows if when(case))
        if fields is not None:
            out.append(Verdict(name=name, precision=p.precision, peak_source=p.source, **fields))
    return out


# ---------------------------------------------------------------------------------------------- convergence


def check_finite(steps: Sequence[StepMetrics]) -> Verdict:
    """No NaN/Inf loss or grad norm at any step."""
    for m in steps:
        if not math.isfinite(m.loss):
            return Verdict(
                name="finite", passed=False, measured=m.loss, step=m.step, reason=f"loss is {m.loss} at step {m.step}"
            )
        if m.grad_norm is not None and not math.isfinite(m.grad_norm):
            return Verdict(
                name="finite",
                passed=False,
                measured=m.grad_norm,
                step=m.step,
                reason=f"grad_norm is {m.grad_norm} at step {m.step}",
            )
    return Verdict(name="finite", passed=True, reason=f"loss and grad_norm finite over {len(steps)} steps")


def check_loss_drop(
    steps: Sequence[StepMetrics], min_drop: float, window: int = 0, stopped_early: bool = False
) -> Verdict:
    """The Theil–Sen trend of the loss over the last `window` steps (0 = all) falls by at least `min_drop`.
    Too few losses for a trend fail a finished run, but only skip one stopped early (a window or budget end):
    a short night says nothing about convergence, and the continuation judges the whole curve."""
    pts = [m for m in (steps[-window:] if window else steps) if math.isfinite(m.loss)]
    if len(pts) < 3:
        reason = f"only {len(pts)} finite losses in the window; a trend needs at least 3"
        if stopped_early:
            return Verdict(
                name="loss_drop",
                passed=True,
                skipped=True,
                threshold=min_drop,
                reason=reason + " (the run stopped early; its continuation is judged on the whole curve)",
            )
        return Verdict(name="loss_drop", passed=min_drop == 0, threshold=min_drop, reason=reason)
    xs = [float(m.step) for m in pts]
    slope, icpt = theil_sen(xs, [m.loss for m in pts])
    start, end = icpt + slope * xs[0], icpt + slope * xs[-1]
    drop = (start - end) / abs(start) if start else 0.0
    ok = drop >= min_drop
    return Verdict(
        name="loss_drop",
        passed=ok,
        measured=drop,
        threshold=min_drop,
        reason=f"fitted loss {start:.4f} → {end:.4f} over steps {pts[0].step}–{pts[-1].step}: "
        f"drop {drop:.1%} {'>=' if ok else '<'} {min_drop:.1%}" + ("" if ok else " (not learning)"),
    )


def check_spikes(
    steps: Sequence[StepMetrics],
    k: float,
    history: int = 8,
    rel_floor: float = 1e-3,
    min_rise: float = 0.0,
    sustain: int = 1,
) -> Verdict:
    """A spike: a loss above the median of the previous `history` losses by more than k × the local noise σ,
    estimated from the σ-scaled MAD of second differences over the previous 4·`history` losses (second
    differences cancel a smooth trend, so a steep descent is not mistaken for noise; Var(Δ²) = 6σ²).
    Resume (`gap`) steps are never spikes. σ is floored at `rel_floor` × median loss. A spike must also exceed
    the trailing median by `min_rise` (a fraction): per-batch losses of a heterogeneous corpus are heavy-tailed,
    and a hard batch is not a divergence. With `sustain` > 1 the rise must hold for that many consecutive steps
    (the smallest of them is judged): instabilities persist, one or two hard batches do not."""
    pts = [m for m in steps if math.isfinite(m.loss)]
    first = 5
    if len(pts) <= first:
        return Verdict(
            name="spikes",
            passed=True,
            skipped=True,
            threshold=k,
            reason=f"only {len(pts)} finite losses; spike detection needs more than {first}",
        )
    floor = rel_floor * abs(statistics.median(m.loss for m in pts))
    worst: tuple[StepMetrics, float] | None = None  # (step, rise in units of the noise scale)
    top = 0.0
    for i in range(first, len(pts)):
        m = pts[i]
        if m.gap:
            continue
        recent = [p.loss for p in pts[max(0, i - history) : i]]
        ys = [p.loss for p in pts[max(0, i - 4 * history) : i]]
        d2 = [ys[j] - 2 * ys[j - 1] + ys[j - 2] for j in range(2, len(ys))]
        scale = max(_mad(d2) / math.sqrt(6), floor)
        med = statistics.median(recent)
        held = [p.loss for p in pts[i : i + sustain] if not p.gap]
        level = min(held) if held else m.loss
        rise = (level - med) / scale
        top = max(top, rise)
        if rise > k and level > med * (1 + min_rise) and (worst is None or rise > worst[1]):
            worst = (m, rise)
    if worst is None:
        reason = f"no rise above {k:g} × MAD and {min_rise:.0%} over the trailing median (largest {top:.1f} × MAD)"
        return Verdict.compared("spikes", True, top, k, None, reason)
    m, x = worst
    reason = f"loss spike at step {m.step}: {m.loss:.4f} is {x:.1f} × MAD above the trailing median (limit {k:g} × MAD)"
    return Verdict.compared("spikes", False, x, k, m.step, reason)


def check_grad_norm(steps: Sequence[StepMetrics], max_norm: float | None) -> Verdict:
    """Every recorded grad norm is at most `max_norm` (pre-clipping norms, as the trainer logs them)."""
    if max_norm is None:
        return Verdict(name="grad_norm", passed=True, skipped=True, reason="grad_norm_max not set")
    norms = [m for m in steps if m.grad_norm is not None]
    if not norms:
        return Verdict(
            name="grad_norm",
            passed=False,
            threshold=max_norm,
            reason="grad_norm_max is set but no step recorded grad_norm",
        )
    worst = max(norms, key=lambda m: m.grad_norm if math.isfinite(m.grad_norm) else math.inf)
    g = worst.grad_norm
    ok = math.isfinite(g) and g <= max_norm
    reason = f"max grad_norm {g:.4g} at step {worst.step} {'<=' if ok else '>'} {max_norm:g}"
    return Verdict.compared("grad_norm", ok, g, max_norm, worst.step, reason)


def check_eval(steps: Sequence[StepMetrics], spec: ValidateSpec) -> list[Verdict]:
    """Held-out gates (validate.eval_every > 0): `eval_falls` (last eval loss below the first) and `eval_overfit`
    (last at most `eval_max_rise` above the best so far: held-out loss rising while training loss falls)."""
    evals = [(m.step, m.eval_loss) for m in steps if m.eval_loss is not None]
    if not evals:
        reason = "validate.eval_every is set but no step recorded eval_loss"
        return [Verdict(name="eval_falls", passed=False, reason=reason)]
    bad = next(((s, v) for s, v in evals if not math.isfinite(v)), None)
    if bad is not None:
        return [Verdict(name="eval_falls", passed=False, step=bad[0], reason=f"eval loss {bad[1]} at step {bad[0]}")]
    (s0, first), (s1, last) = evals[0], evals[-1]
    out = []
    if not spec.eval_must_fall:
        out.append(Verdict(name="eval_falls", passed=True, skipped=True, reason="eval_must_fall is false"))
    elif len(evals) < 2:
        out.append(Verdict(name="eval_falls", passed=True, skipped=True, reason=f"one evaluation only (step {s0})"))
    else:
        ok = last < first
        reason = f"eval loss {first:.4f} at step {s0} -> {last:.4f} at step {s1} ({'fell' if ok else 'did not fall'})"
        out.append(Verdict.compared("eval_falls", ok, last, first, s1, reason))
    best_step, best = min(evals, key=lambda e: e[1])
    limit = best * (1 + spec.eval_max_rise)
    ok = last <= limit
    reason = (
        f"last eval loss {last:.4f} {'<=' if ok else '>'} best {best:.4f} (step {best_step}) "
        f"x (1 + {spec.eval_max_rise:g})"
    )
    out.append(Verdict.compared("eval_overfit", ok, last, limit, s1, reason))
    return out


def check_golden(
    steps: Sequence[StepMetrics], golden: Sequence[StepMetrics], rtol: float, source: str = "golden curve"
) -> Verdict:
    """At every step present in both curves, |loss − golden| <= rtol · |golden|."""
    ref = {m.step: m.loss for m in golden}
    pairs = [(m.step, m.loss, ref[m.step]) for m in steps if m.step in ref]
    if not pairs:
        return Verdict(
            name="golden",
            passed=False,
            threshold=rtol,
            reason=f"no step in common with the {source} ({len(golden)} steps)",
        )
    worst_step, worst_err = None, -1.0
    for step, loss, g in pairs:
        err = abs(loss - g) / abs(g) if g else abs(loss - g)
        if not math.isfinite(err):
            err = math.inf
        if err > worst_err:
            worst_step, worst_err = step, err
    ok = worst_err <= rtol
    reason = (
        f"max relative deviation from the {source} {worst_err:.2%} at step {worst_step} "
        f"over {len(pairs)} steps {'<=' if ok else '>'} rtol {rtol:.2%}"
    )
    return Verdict.compared("golden", ok, worst_err, rtol, worst_step, reason)


def load_golden(path: str | Path) -> list[StepMetrics]:
    """A golden curve: JSONL of {step, loss} (the metrics format); errors name file and line."""
    return read_metrics(path)


@dataclass(frozen=True)
class GoldenCurve:
    """A golden loss curve and where it came from; `steps` is None when there is none yet (gate skipped)."""

    steps: list[StepMetrics] | None
    source: str


def resolve_golden(golden: GoldenSpec, ledger=None, spec_hash: str | None = None) -> GoldenCurve | None:
    """The configured golden curve: `golden.path`, or the metrics of the ledger's best verified run of the same
    spec (`ledger`: a nightloom.ledger.Ledger). None when no golden curve is configured. The first run of a
    spec has no ledger curve yet: that is a skipped gate, not a failure."""
    if golden.path:
        return GoldenCurve(load_golden(golden.path), f"golden curve {golden.path}")
    if not golden.from_ledger:
        return None
    if ledger is None or spec_hash is None:
        raise ValueError("validate.golden.from_ledger is set: pass the ledger and the spec hash")
    run = ledger.golden_run(spec_hash)
    if run is None:
        return GoldenCurve(None, f"no verified ledger run of spec {spec_hash} yet")
    return GoldenCurve(load_golden(run.metrics_path), f"ledger run {run.run_id} ({run.metrics_path})")


# ---------------------------------------------------------------------------------------------- all gates


def validate_run(
    steps: Sequence[StepMetrics],
    spec: ValidateSpec,
    mfu_inputs: MfuInputs | None = None,
    golden: GoldenCurve | Sequence[StepMetrics] | None = None,
    golden_source: str = "golden curve",
    stopped_early: bool = False,
    task: str = "pretrain",
) -> list[Verdict]:
    """Every configured gate, in a fixed order. Pass `mfu_inputs=None` only when MFU is not gated at all;
    `stopped_early` when the run stopped before its last step (a window or budget end). `task` grpo: the loss is
    a policy-gradient surrogate (about 0, whatever the policy learns): its loss and eval-loss gates are skipped,
    validate.min_reward_gain judges the run."""
    if not steps:
        if stopped_early:  # a window or budget end before step 1 (start-up took what was left): nothing to judge
            reason = "stopped at its window or budget end before step 1: no step to validate"
            return [Verdict(name="steps", passed=True, skipped=True, measured=0, reason=reason)]
        raise ValueError("validate_run: no metrics steps")
    out: list[Verdict] = []
    if mfu_inputs is not None:
        out += check_mfu(steps, spec, mfu_inputs)
    elif spec.mfu_floor > 0 or spec.mfu_vs_plan > 0:
        raise PeakError("validate.mfu_floor/mfu_vs_plan is set but no peak/FLOPs were given to validate the run")
    out.append(check_finite(steps))
    if task == "grpo":
        why = "train.task grpo: the loss is a policy-gradient surrogate; validate.min_reward_gain judges the run"
        out.append(Verdict(name="loss_drop", passed=True, skipped=True, reason=why))
    else:
        out.append(check_loss_drop(steps, spec.min_loss_drop, spec.window, stopped_early))
        out.append(check_spikes(steps, spec.spike_k, min_rise=spec.spike_min_rise, sustain=spec.spike_sustain))
    out.append(check_grad_norm(steps, spec.grad_norm_max))
    if spec.eval_every > 0 and task != "grpo":  # grpo's held-out figure is the mean reward (reward_gain)
        out += check_eval(steps, spec)
    if spec.min_reward_accuracy is not None:  # train.task dpo: nightloom/train/preference/gates.py
        out.append(Verdict(name="reward_accuracy", **asdict(reward_accuracy(steps, spec.min_reward_accuracy))))
    if spec.min_reward_gain is not None:  # train.task grpo: nightloom/train/rollout/gates.py
        out.append(Verdict(name="reward_gain", **asdict(reward_gain(steps, spec.min_reward_gain))))
    if isinstance(golden, GoldenCurve):
        if golden.steps is None:
            out.append(
                Verdict(name="golden", passed=True, skipped=True, threshold=spec.golden.rtol, reason=golden.source)
            )
        else:
            out.append(check_golden(steps, golden.steps, spec.golden.rtol, golden.source))
    elif golden is not None:
        out.append(check_golden(steps, golden, spec.golden.rtol, golden_source))
    elif spec.golden.path or spec.golden.from_ledger:
        out.append(
            Verdict(
                name="golden",
                passed=False,
                threshold=spec.golden.rtol,
                reason="a golden curve is configured but none was loaded",
            )
        )
    return out


def failed(verdicts: Sequence[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if not v.passed]


def require_passed(verdicts: Sequence[Verdict]) -> None:
    """Raise ValidationFailed listing every failing gate's reason (the flow fails with it)."""
    bad = failed(verdicts)
    if bad:
        raise ValidationFailed(bad)
