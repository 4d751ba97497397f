"""What to rent: for each GPU type (at its price) and each node count up to a number of GPUs, the planner's best
layout and its hours, the nights the spec's windows and policy give, the finish and the cost; the choice is the
cheapest option that meets the deadline and the budget, or, when none does, the fastest, with the reason.

An option's hours are the planner's for that type and count (what `nightloom plan` says), its nights and cost the
plan of nights `nightloom cost` prints (nightloom.schedule.nights), priced at the type's price with the spec's
off-peak discount; time to ready and checkpoint time come from the spec (a measured run belongs to one cluster).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo

from nightloom.planner import plan_for_spec
from nightloom.schedule.errors import ScheduleError
from nightloom.schedule.inputs import inputs_for_spec
from nightloom.schedule.nights import plan_nights
from nightloom.spec import RunSpec


@dataclass(frozen=True)
class GpuPrice:
    """One GPU type on offer and its list price per GPU-hour."""

    gpu_type: str
    price_per_gpu_hour: float


def parse_gpu_prices(text: str) -> list[GpuPrice]:
    """'h100-80gb=2.5,a100-80gb=1.6' → [GpuPrice(...), ...]; ValueError naming the bad item."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        name, sep, price = item.partition("=")
        try:
            value = float(price)
        except ValueError:
            value = math.nan
        if not sep or not name.strip() or not math.isfinite(value) or value < 0:
            raise ValueError(f"--gpus: expected TYPE=PRICE (a price per GPU-hour >= 0), got {item!r}")
        out.append(GpuPrice(name.strip(), value))
    if len({g.gpu_type for g in out}) != len(out):
        raise ValueError(f"--gpus names a GPU type twice: {text!r}")
    return out


@dataclass(frozen=True)
class RentOption:
    """One GPU type and count: its layout and hours (the planner's), nights, finish and cost."""

    gpu_type: str
    gpus: int
    nodes: int
    layout: str
    hours: float  # training hours: the planner's step time × train.steps
    nights: int
    finish: datetime
    cost: float
    meets_deadline: bool | None  # None without a deadline
    within_budget: bool | None  # None without a budget
    overhead_cost: float = 0.0  # of `cost`: the nodes rented while they provision, restore and checkpoint
    provisioning_min: float = 0.0  # time to ready each night (the spec's, else 10 min)

    @property
    def acceptable(self) -> bool:
        return self.meets_deadline is not False and self.within_budget is not False

    def cost_text(self, currency: str) -> str:
        """'0.83 USD (0.83 provisioning + 0.00 training)': the money paid while the nodes get ready (and restore or
        save checkpoints) said apart from training's, since a short run's cost is mostly the former."""
        total = f"{self.cost:,.2f} {currency}"
        if self.overhead_cost <= 0:
            return total
        return f"{total} ({self.overhead_cost:,.2f} provisioning + {self.cost - self.overhead_cost:,.2f} training)"


@dataclass(frozen=True)
class RentRejected:
    """A GPU type and count that cannot run the spec at all, and why (no layout fits, the nights never fit)."""

    gpu_type: str
    gpus: int
    reason: str


@dataclass(frozen=True)
class RentChoice:
    """Every option, those rejected, and the one chosen (None only when every option was rejected)."""

    options: list[RentOption]
    rejected: list[RentRejected]
    choice: RentOption | None
    reason: str
    timezone: str

    def to_json(self) -> dict:
        tz = ZoneInfo(self.timezone)

        def row(o: RentOption) -> dict:
            keys = ("gpu_type", "gpus", "nodes", "layout", "hours", "finish", "cost", "overhead_cost", "meets_deadline")
            d = {k: getattr(o, k) for k in keys}
            return d | {"finish": o.finish.astimezone(tz).isoformat()}

        choice = None if self.choice is None else row(self.choice) | {"reason": self.reason}
        return {
            "options": [row(o) for o in self.options],
            "choice": choice,
            "rejected": [{"gpu_type": r.gpu_type, "gpus": r.gpus, "reason": r.reason} for r in self.rejected],
        }


def option_spec(spec: RunSpec, gpu_type: str, nodes: int) -> RunSpec:
    """The spec on `nodes` nodes of `gpu_type` (gpus per node, model, batch and schedule unchanged)."""
    out = spec.model_copy(deep=True)
    out.cluster.gpu_type = gpu_type
    out.cluster.nodes = nodes
    return out


def rent_options(
    spec: RunSpec,
    prices: list[GpuPrice],
    now: datetime,
    *,
    max_gpus: int | None = None,
    deadline: datetime | None = None,
    budget: float | None = None,
) -> RentChoice:
    """Every option of `prices` × node counts up to `max_gpus` GPUs (default: the spec's world size), and the
    choice. `budget` defaults to schedule.budget."""
    per_node = spec.cluster.gpus_per_node
    limit = spec.world_size if max_gpus is None else max_gpus
    if limit < per_node:
        raise ValueError(f"--max-gpus {limit} is less than one node ({per_node} GPUs: cluster.gpus_per_node)")
    budget = spec.schedule.budget if budget is None else budget
    options: list[RentOption] = []
    rejected: list[RentRejected] = []
    for offer in prices:
        for nodes in range(1, limit // per_node + 1):
            got = _option(spec, offer, nodes, now, deadline, budget)
            (options if isinstance(got, RentOption) else rejected).append(got)
    choice, reason = _choose(options, deadline, budget, spec.schedule.currency, spec.schedule.timezone)
    return RentChoice(options, rejected, choice, reason, spec.schedule.timezone)


def _option(
    spec: RunSpec, offer: GpuPrice, nodes: int, now: datetime, deadline: datetime | None, budget: float | None
) -> RentOption | RentRejected:
    gpus = nodes * spec.cluster.gpus_per_node
    try:
        variant = option_spec(spec, offer.gpu_type, nodes)
        chosen = plan_for_spec(variant, require_fit=False).chosen
    except (ValueError, KeyError) as e:  # an unknown GPU type, a layout the world size does not divide
        return RentRejected(offer.gpu_type, gpus, str(e.args[0] if isinstance(e, KeyError) else e))
    if chosen.fits is False:
        return RentRejected(offer.gpu_type, gpus, f"no layout fits in memory (smallest: {chosen.layout()})")
    if not chosen.step_time_s:
        return RentRejected(offer.gpu_type, gpus, "the planner predicts no step time for this GPU type")
    variant.schedule.price_per_gpu_hour = offer.price_per_gpu_hour
    inputs = inputs_for_spec(variant, planner_step_s=chosen.step_time_s, planner_detail=chosen.layout())
    try:
        plan = plan_nights(variant.schedule, now, inputs)
    except ScheduleError as e:
        return RentRejected(offer.gpu_type, gpus, str(e))
    return RentOption(
        gpu_type=offer.gpu_type,
        gpus=gpus,
        nodes=nodes,
        layout=chosen.layout(),
        hours=plan.training_s / 3600.0,
        nights=len(plan.nights),
        finish=plan.finish,
        cost=plan.cost,
        meets_deadline=None if deadline is None else plan.finish <= deadline,
        within_budget=None if budget is None else plan.cost <= budget,
        overhead_cost=sum(g.cost for n in plan.nights for g in n.segments if g.what != "training"),
        provisioning_min=inputs.provisioning_s / 60.0,
    )


def _choose(
    options: list[RentOption], deadline: datetime | None, budget: float | None, currency: str, timezone: str
) -> tuple[RentOption | None, str]:
    if not options:
        return None, "no GPU type and count can run this spec (see rejected)"
    wanted = " and ".join(
        x
        for x in (
            None if deadline is None else f"finish by {deadline.astimezone(ZoneInfo(timezone)).isoformat()}",
            None if budget is None else f"cost at most {budget:,.2f} {currency}",
        )
        if x
    )
    good = [o for o in options if o.acceptable]
    if good:
        best = min(good, key=lambda o: (o.cost, o.finish, o.gpus, o.gpu_type))
        why = f"the cheapest of {len(good)} options" + (f" that {wanted}" if wanted else "")
        return best, why
    fastest = min(options, key=lambda o: (o.finish, o.cost, o.gpus, o.gpu_type))
    late = "misses the deadline" if fastest.meets_deadline is False else ""
    over = "is over the budget" if fastest.within_budget is False else ""
    return fastest, (
        f"no option can {wanted}: the fastest, chosen, "
        + " and ".join(x for x in (late, over) if x)
        + f" ({fastest.cost:,.2f} {currency})"
    )
