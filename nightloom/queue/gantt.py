"""The Gantt chart of a queue plan (PNG): one panel per night (the days between left out), one row per node,
one bar per segment coloured by job (provisioning, restore and checkpoint paler and hatched), times in the queue's
time zone.

matplotlib's object API on the Agg canvas (no pyplot, no global backend), written atomically, as nightloom.plots.
"""

from __future__ import annotations

import io
from datetime import timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

from matplotlib import dates as mdates
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from nightloom.queue.timetable import PlannedNight, QueuePlan
from nightloom.util import atomic_write_bytes
from nightloom.wording import plural

PALE = {"provisioning": 0.35, "restore": 0.5, "checkpoint": 0.5}  # alpha of the overheads; training is solid


MAX_PANELS = 14  # nights drawn; a longer plan shows its first nights and says how many more


def plot_queue_gantt(plan: QueuePlan, path: str | Path, title: str = "night queue") -> Path:
    """Draw `plan` to `path` (PNG), one panel per night (the days between are left out), and return the path."""
    tz = ZoneInfo(plan.timezone)
    rows = max(1, plan.max_nodes)
    nights = list(plan.nights[:MAX_PANELS]) or [None]
    widths = [1.0 if n is None else max(n.end - n.start, timedelta(minutes=30)).total_seconds() for n in nights]
    fig = Figure(figsize=(min(18, 2.0 + 2.2 * len(nights)), 1.6 + 0.45 * rows), layout="constrained")
    axes = fig.subplots(1, len(nights), sharey=True, squeeze=False, gridspec_kw={"width_ratios": widths})[0]
    colors = {j.job.id: f"C{i % 10}" for i, j in enumerate(plan.jobs)}
    for ax, night in zip(axes, nights):
        if night is not None:
            _draw_night(ax, plan, night, colors, tz)
        ax.set_yticks(range(rows), [f"node {i}" for i in range(rows)])
        ax.set_ylim(rows - 0.5, -0.5)
        ax.grid(axis="x", alpha=0.3)
    handles = []
    for j in plan.jobs:
        state = "unplanned" if not j.scheduled else "late" if j.meets_deadline is False else ""
        label = f"#{j.job.id} {j.job.name} (p{j.job.priority}, {plural(j.job.nodes, 'node')}, {j.job.hours:.1f} h)"
        handles.append(Patch(facecolor=colors[j.job.id], label=label + (f": {state}" if state else "")))
    handles.append(Patch(facecolor="0.6", alpha=0.4, hatch="//", label="provision / restore / checkpoint"))
    more = len(plan.nights) - MAX_PANELS
    suffix = f" (first {MAX_PANELS} of {len(plan.nights)} nights)" if more > 0 else ""
    fig.suptitle(f"{title}: {plan.cost:,.2f} {plan.currency}{suffix}; times in {plan.timezone}")
    axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, buf.getvalue())
    return out


def _draw_night(ax, plan: QueuePlan, night: PlannedNight, colors: dict[int, str], tz: ZoneInfo) -> None:
    for j in plan.jobs:
        for s in j.segments:
            if not (night.start <= s.start < night.end):
                continue
            x0, x1 = mdates.date2num(s.start), mdates.date2num(s.end)
            for node in s.nodes:
                ax.broken_barh(
                    [(x0, x1 - x0)],
                    (node - 0.4, 0.8),
                    facecolors=colors[j.job.id],
                    alpha=PALE.get(s.what, 0.95),
                    hatch="//" if s.what in PALE else None,
                    edgecolor="white",
                    lw=0.5,
                )
    ax.set_xlim(mdates.date2num(night.start), mdates.date2num(night.end))
    ax.xaxis.set_major_locator(mdates.HourLocator(interval=1, tz=tz))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=tz))
    ax.tick_params(axis="x", labelsize=7, rotation=90)
    budget = "" if night.budget is None else f" / {night.budget:,.0f}"
    ax.set_title(f"{night.start.astimezone(tz):%a %m-%d}\n{night.cost:,.2f}{budget}", fontsize=8)
