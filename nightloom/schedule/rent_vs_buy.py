"""Renting vs owning: the monthly cost of the GPU-hours a team rents against a self-built cluster of the same
size (amortised price, operations, idle time, and the rent paid while the hardware is on its way). `nightloom
cost` prints it beside the plan of nights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

HOURS_PER_MONTH = 730.0  # 8760 / 12


@dataclass(frozen=True)
class RentVsBuy:
    """Monthly cost of renting the GPU-hours a team uses vs owning a cluster of the same size.

    Owning: purchase price amortised over `amortisation_months` + operations per month (power, space, staff);
    only (1 − idle_fraction) of the owned hours are useful. Buying takes lead_time_days to arrive, during
    which the team rents anyway."""

    gpus: int
    gpu_hours_per_month: float
    rent_price_per_gpu_hour: float  # blended: off-peak share discounted
    rent_per_month: float
    purchase_price: float | None
    amortisation_months: int
    operations_per_month: float
    idle_fraction: float
    own_per_month: float | None
    own_useful_gpu_hours: float
    own_per_useful_gpu_hour: float | None
    break_even_gpu_hours_per_month: float | None  # renting beyond this costs more than owning
    break_even_purchase_price: float | None  # owning is cheaper below this price at this usage
    lead_time_days: tuple[int, int]
    lead_time_rent: tuple[float, float]
    currency: str
    cheaper: Literal["rent", "buy", "unknown"]
    over_capacity: bool  # the usage needs more than the owned cluster's useful hours


def not_compared(gpu_type: str, rent_price_per_gpu_hour: float) -> str | None:
    """Why renting and buying are not compared for this run (None: they are): CPU ranks are machines the team
    already has (no GPUs to rent or buy), and without a price renting costs nothing to compare against."""
    if gpu_type == "cpu":
        return "gpu_type cpu: the ranks run on machines you have, with no GPUs to rent or to buy"
    if rent_price_per_gpu_hour <= 0:
        return "no rent price (set schedule.price_per_gpu_hour)"
    return None


def rent_vs_buy(
    *,
    gpus: int,
    gpu_hours_per_month: float,
    rent_price_per_gpu_hour: float,
    purchase_price: float | None = None,
    amortisation_months: int = 36,
    operations_per_month: float = 28_000.0,
    idle_fraction: float = 0.37,
    lead_time_days: tuple[int, int] = (45, 90),
    currency: str = "USD",
) -> RentVsBuy:
    """Compare renting with a self-built cluster. Defaults are the figures commonly quoted for small teams:
    28,000/month operations, 37% idle, 45–90 days from order to running hardware."""
    if gpus <= 0 or gpu_hours_per_month < 0 or rent_price_per_gpu_hour < 0 or amortisation_months <= 0:
        raise ValueError("gpus and amortisation_months must be > 0; hours and prices >= 0")
    if not 0 <= idle_fraction < 1:
        raise ValueError(f"idle_fraction must be in [0, 1), got {idle_fraction}")
    rent = gpu_hours_per_month * rent_price_per_gpu_hour
    useful = gpus * HOURS_PER_MONTH * (1 - idle_fraction)
    own = None if purchase_price is None else purchase_price / amortisation_months + operations_per_month
    per_useful = None if own is None else own / useful
    be_hours = None if own is None or rent_price_per_gpu_hour == 0 else own / rent_price_per_gpu_hour
    be_price = max(0.0, (rent - operations_per_month) * amortisation_months)
    per_day = rent / (HOURS_PER_MONTH / 24)
    cheaper: Literal["rent", "buy", "unknown"] = "unknown" if own is None else ("buy" if own < rent else "rent")
    return RentVsBuy(
        gpus=gpus,
        gpu_hours_per_month=gpu_hours_per_month,
        rent_price_per_gpu_hour=rent_price_per_gpu_hour,
        rent_per_month=rent,
        purchase_price=purchase_price,
        amortisation_months=amortisation_months,
        operations_per_month=operations_per_month,
        idle_fraction=idle_fraction,
        own_per_month=own,
        own_useful_gpu_hours=useful,
        own_per_useful_gpu_hour=per_useful,
        break_even_gpu_hours_per_month=be_hours,
        break_even_purchase_price=be_price,
        lead_time_days=lead_time_days,
        lead_time_rent=(per_day * lead_time_days[0], per_day * lead_time_days[1]),
        currency=currency,
        cheaper=cheaper,
        over_capacity=gpu_hours_per_month > useful,
    )
