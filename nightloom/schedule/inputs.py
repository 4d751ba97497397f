"""The figures a plan of nights is computed from, each from the best source there is (given, the ledger's
measurements, the planner, the spec, a default), and the checkpoint time a model's size implies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from nightloom.model_resolver import model_shape
from nightloom.perf import count_params
from nightloom.schedule.errors import ScheduleError, StepTimeUnknown
from nightloom.schedule.nights import NightInputs
from nightloom.spec import RunSpec

if TYPE_CHECKING:
    from nightloom.ledger import RunRecord

DEFAULT_PROVISIONING_S = 600.0  # 10 min from renting to ready when neither the ledger nor the spec says
# Mixed-precision Adam holds 16 B/param: 2 (bf16 weights) + 2 (grads) + 12 (fp32 master weights, Adam's m and v)
# (Rajbhandari et al. 2020, "ZeRO", section 3.1; the same states nightloom/planner/memory.py counts per GPU). A DCP
# checkpoint saves the 12: the fp32 master weights, m and v (the bf16 working copy and the gradients are not saved).
CHECKPOINT_BYTES_PER_PARAM = 12.0


def checkpoint_seconds(params: int, gb_per_s: float) -> float:
    """Time to write (or read) one training checkpoint of a `params`-parameter model at `gb_per_s`."""
    return params * CHECKPOINT_BYTES_PER_PARAM / (gb_per_s * 1e9)


def step_time_unknown(spec: RunSpec) -> StepTimeUnknown:
    """The one error `nightloom cost` and `nightloom queue add` give when no source has a step time."""
    return StepTimeUnknown(
        f"no step time for {spec.name}: the planner predicts none for gpu_type {spec.cluster.gpu_type!r} and the "
        f"ledger has no measured run of this spec: give --hours (training hours for its {spec.train.steps} steps)"
    )


def _step_time(
    spec: RunSpec, runs: Sequence[RunRecord], hours: float | None, planner_step_s: float | None, planner_detail: str
) -> tuple[float | None, str]:
    """(seconds per step, its source): `hours` given > the ledger's newest measured run > the planner > none."""
    t = spec.train
    if hours is not None:
        if hours <= 0:
            raise ScheduleError(f"--hours must be > 0, got {hours}")
        step, step_src = hours * 3600.0 / t.steps, f"given: {hours:g} h for {t.steps} steps"
    else:
        spec_hash = spec.spec_hash()
        measured = next(
            (
                r
                for r in runs
                if r.spec_hash == spec_hash
                and r.cluster == spec.cluster.name
                and r.world_size == spec.world_size
                and r.status in ("succeeded", "stopped")
                and r.tokens_per_s
            ),
            None,
        )
        if measured is not None:
            step = t.global_batch * t.seq_len / measured.tokens_per_s
            step_src = f"ledger: {step:.3f} s/step measured by run {measured.run_id}"
        elif planner_step_s:
            step, step_src = planner_step_s, f"planner: {planner_detail} at {planner_step_s:.3f} s/step".strip()
        else:
            step, step_src = None, "none: the planner predicts no step time here and the ledger has no measurement"
    return step, step_src


def _time_to_ready(spec: RunSpec, runs: Sequence[RunRecord], provisioning_s: float | None) -> tuple[float, str]:
    """(seconds to ready, its source): given > the ledger's newest on the cluster > the spec > 10 min."""
    s = spec.schedule
    if provisioning_s is not None:
        prov, prov_src = provisioning_s, "given"
    else:
        ready = next(
            (
                r
                for r in runs
                if r.cluster == spec.cluster.name and r.provider == spec.cluster.provider.kind and r.time_to_ready_s
            ),
            None,
        )
        if ready is not None:
            prov, prov_src = ready.time_to_ready_s, f"ledger: measured by run {ready.run_id}"
        elif s.provisioning_minutes is not None:
            prov, prov_src = s.provisioning_minutes * 60.0, "spec: schedule.provisioning_minutes"
        else:
            prov, prov_src = DEFAULT_PROVISIONING_S, "default: 10 min"
    return prov, prov_src


def inputs_for_spec(
    spec: RunSpec,
    *,
    planner_step_s: float | None,
    planner_detail: str = "",
    runs: Sequence[RunRecord] = (),
    run_id: str | None = None,
    hours: float | None = None,
    provisioning_s: float | None = None,
) -> NightInputs:
    """The figures a plan of nights needs, each from the best source there is.

    Step time: `hours` (given) > the ledger's measured rate of the newest run of the same spec, cluster and size >
    the planner's prediction > none. Time to ready: `provisioning_s` (given) > the ledger's newest measurement on
    the same cluster > schedule.provisioning_minutes > 10 min. Checkpoint: model size × 12 B/param at
    schedule.checkpoint_gb_per_s. A run `run_id` already in `runs` is a continuation: its nights, steps and money
    carry over."""
    s, t = spec.schedule, spec.train
    mine = next((r for r in runs if run_id is not None and r.run_id == run_id), None)
    steps_done = mine.nights[-1].steps_done if mine is not None and mine.nights else 0
    spent = (sum(n.cost for n in mine.nights) if mine.nights else (mine.cost or 0.0)) if mine is not None else 0.0
    steps = max(0, t.steps - steps_done)
    step, step_src = _step_time(spec, runs, hours, planner_step_s, planner_detail)
    prov, prov_src = _time_to_ready(spec, runs, provisioning_s)
    params = count_params(model_shape(spec.model))
    ckpt = checkpoint_seconds(params, s.checkpoint_gb_per_s)
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    return NightInputs(
        steps=steps,
        gpus=spec.world_size,
        step_time_s=step,
        step_source=step_src,
        provisioning_s=prov,
        provisioning_source=prov_src,
        checkpoint_s=ckpt,
        restore_s=ckpt,
        checkpoint_source=f"{size} params × {CHECKPOINT_BYTES_PER_PARAM:g} B at {s.checkpoint_gb_per_s:g} GB/s",
        resumed=mine is not None,
        steps_done=steps_done,
        nights_used=len(mine.nights) if mine is not None else 0,
        spent=spent,
    )
