"""Record one night of a run (nightloom.schedule.night_record: its cost next to the plan's prediction) in the
ledger row and a `nights` artifact."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom.ledger import Ledger, NightRecord
from nightloom.schedule.gate import GateDecision
from nightloom.schedule.night_record import NightsSoFar, nights_so_far
from nightloom.spec import RunSpec


@task(name="ledger-night", cache_policy=NO_CACHE)  # no retries: an append must not run twice
def record_night_task(spec: RunSpec, run_id: str, decision: GateDecision, night: NightRecord) -> NightsSoFar:
    """Append the night to the run's ledger row (its cost becomes the sum of its nights) and publish the table of
    nights, predicted vs actual."""
    with Ledger(spec.ledger.url) as ledger:
        row = ledger.record_night(run_id, night)
    so_far = nights_so_far(decision, night, row.cost or 0.0, len(row.nights))
    _artifact(spec, row.nights, so_far)
    predicted = "no prediction yet" if night.predicted_steps is None else f"predicted {night.predicted_steps}"
    line = f"night {night.night}: {night.steps} steps ({predicted})"
    if spec.schedule.price_per_gpu_hour > 0:  # costs only where prices are set
        forecast = (
            "unknown" if night.predicted_cost is None else f"{night.predicted_cost:.2f} ± {night.uncertainty or 0:.2f}"
        )
        line += f", {night.cost:.2f} {spec.schedule.currency} (predicted {forecast}); run so far {so_far.run_cost:.2f}"
    get_run_logger().info("%s over %d night(s)", line, so_far.nights_used)
    return so_far


def _artifact(spec: RunSpec, nights: list[NightRecord], so_far: NightsSoFar) -> None:
    from prefect.artifacts import create_table_artifact

    def opt(x, fmt="{:.2f}"):
        return "unknown" if x is None else fmt.format(x)

    rows = [
        {
            "night": n.night,
            "start": n.start.isoformat(timespec="seconds"),
            "steps": f"{n.steps} (predicted {opt(n.predicted_steps, '{}')})",
            "cost": f"{n.cost:.2f} (predicted {opt(n.predicted_cost)} ± {opt(n.uncertainty)})",
            "stopped": n.stopped,
        }
        for n in nights
    ]
    rows.append(
        {
            "night": "total",
            "start": "",
            "steps": f"{nights[-1].steps_done} done",
            "cost": f"{so_far.run_cost:.2f} {spec.schedule.currency}",
            "stopped": f"nights left: {opt(so_far.nights_left, '{}')}; predicted finish: "
            f"{so_far.predicted_finish or 'unknown'}",
        }
    )
    try:
        create_table_artifact(key="nights", table=rows, description="Nights of this run: predicted vs actual")
    except Exception as e:  # noqa: BLE001 - an artifact never fails the run
        get_run_logger().warning("could not write the nights artifact: %s", type(e).__name__)
