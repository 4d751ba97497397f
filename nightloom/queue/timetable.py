"""The timetable of a night queue: many jobs packed onto one cluster's nodes inside the off-peak windows, by priority.

Jobs are placed one at a time, highest priority first (priority 1 first, then the earliest deadline, then the
order they were added), each at the earliest time its nodes are free, so a job never delays one placed before it
and smaller jobs run side by side in what is left. A `wait` job runs in one stretch inside one window; a `split`
job runs in stretches, each inside a window, checkpointing at a stretch's end and restoring at the next one's start
(every stretch provisions its nodes anew, as the plan of nights prices: nightloom.schedule.nights). The queue never
holds more than `max_nodes` nodes at once and a night never costs more than the queue's nightly budget. Each
stretch then takes the lowest-numbered free nodes, so the jobs running at one time hold disjoint sets of nodes.
Pure: the current time is an argument, and the same queue gives the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from nightloom.queue.jobs import QueuedJob
from nightloom.schedule.cost import priced_segments, rates_per_s
from nightloom.schedule.errors import ScheduleError
from nightloom.schedule.nights import MAX_PLANNED_NIGHTS
from nightloom.schedule.windows import Interval, aware_utc, hours_text, local_time_format, windows_between
from nightloom.spec import ScheduleSpec
from nightloom.wording import plural


@dataclass(frozen=True)
class PlannedSegment:
    """One piece of a stretch: provisioning, restore, training or checkpoint, on the nodes it holds."""

    start: datetime
    end: datetime
    what: str
    nodes: tuple[int, ...]
    cost: float

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


@dataclass(frozen=True)
class PlannedJob:
    """A job's place in the plan: its segments, finish, whether it meets its deadline, and why not."""

    job: QueuedJob
    segments: tuple[PlannedSegment, ...]
    reason: str = ""  # why a deadline is missed or the job cannot be planned; "" when neither

    @property
    def scheduled(self) -> bool:
        return bool(self.segments)

    @property
    def start(self) -> datetime | None:
        return self.segments[0].start if self.segments else None

    @property
    def finish(self) -> datetime | None:
        return self.segments[-1].end if self.segments else None

    @property
    def cost(self) -> float:
        return sum(s.cost for s in self.segments)

    @property
    def meets_deadline(self) -> bool | None:
        """None without a deadline; False when the job cannot be planned at all."""
        if self.job.deadline is None:
            return None
        return self.finish is not None and self.finish <= self.job.deadline


@dataclass(frozen=True)
class PlannedNight:
    """One window occurrence the queue uses, what it costs and the queue's budget for it."""

    start: datetime
    end: datetime
    cost: float
    budget: float | None


@dataclass(frozen=True)
class QueuePlan:
    """The plan: every job (in placement order) and every night it uses."""

    at: datetime
    timezone: str
    currency: str
    max_nodes: int
    jobs: tuple[PlannedJob, ...]
    nights: tuple[PlannedNight, ...]

    @property
    def cost(self) -> float:
        return sum(j.cost for j in self.jobs)

    def nodes_held(self) -> list[tuple[datetime, int]]:
        """(time, nodes held from then on) at every change: the plan never exceeds max_nodes."""
        events: dict[datetime, int] = {}
        for j in self.jobs:
            for s in j.segments:
                events[s.start] = events.get(s.start, 0) + len(s.nodes)
                events[s.end] = events.get(s.end, 0) - len(s.nodes)
        held, out = 0, []
        for t in sorted(events):
            held += events[t]
            out.append((t, held))
        return out

    def to_json(self) -> dict:
        """The `queue plan --json` object; times in the queue's time zone, a segment's `nodes` the node indices."""
        tz = ZoneInfo(self.timezone)

        def iso(t: datetime | None) -> str | None:
            return None if t is None else t.astimezone(tz).isoformat()

        return {
            "jobs": [
                {
                    "id": j.job.id,
                    "name": j.job.name,
                    "priority": j.job.priority,
                    "nodes": j.job.nodes,
                    "hours": j.job.hours,
                    "deadline": iso(j.job.deadline),
                    "finish": iso(j.finish),
                    "meets_deadline": j.meets_deadline,
                    "cost": j.cost,
                    "reason": j.reason or None,
                    "segments": [
                        {
                            "start": iso(s.start),
                            "end": iso(s.end),
                            "what": s.what,
                            "nodes": list(s.nodes),
                            "cost": s.cost,
                        }
                        for s in j.segments
                    ],
                }
                for j in self.jobs
            ],
            "nights": [
                {"start": iso(n.start), "end": iso(n.end), "cost": n.cost, "budget": n.budget} for n in self.nights
            ],
        }


# ---------------------------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class _Stretch:
    """A job's hold on `nodes` nodes from start to end, in one window, and the parts it is made of."""

    job_id: int
    start: datetime
    end: datetime
    nodes: int
    window: Interval
    parts: tuple[tuple[str, float], ...]  # (what, seconds) from start
    cost: float


@dataclass
class _Board:
    """What is already placed: the stretches (for the nodes) and each night's spending (for the budget)."""

    max_nodes: int
    budget: float | None
    stretches: list[_Stretch] = field(default_factory=list)
    spent: dict[datetime, float] = field(default_factory=dict)  # window start -> cost placed in it

    def held(self, t: datetime) -> int:
        return sum(s.nodes for s in self.stretches if s.start <= t < s.end)

    def free_until(self, a: datetime, nodes: int, limit: datetime) -> datetime:
        """The latest end ≤ `limit` such that `nodes` more nodes stay free over [a, end); `a` itself when none."""
        if self.held(a) + nodes > self.max_nodes:
            return a
        for t in sorted({s.start for s in self.stretches if a < s.start < limit}):
            if self.held(t) + nodes > self.max_nodes:
                return t
        return limit

    def candidates(self, win: Interval, after: datetime) -> list[datetime]:
        """Where a stretch may start in `win` no earlier than `after`: its start, and each time nodes come free."""
        lo = max(win.start, after)
        ends = {s.end for s in self.stretches if lo < s.end < win.end}
        return sorted({lo, *ends}) if lo < win.end else []

    def money_left(self, win: Interval) -> float:
        return math.inf if self.budget is None else self.budget - self.spent.get(win.start, 0.0)

    def place(self, s: _Stretch) -> None:
        self.stretches.append(s)
        self.spent[s.window.start] = self.spent.get(s.window.start, 0.0) + s.cost


class _Windows:
    """The queue's (merged) window occurrences from `at` on, listed as far as a search asks."""

    def __init__(self, schedule: ScheduleSpec, at: datetime):
        self.schedule, self.at = schedule, at
        self.days = 0
        self.items: list[Interval] = []

    def __getitem__(self, i: int) -> Interval:
        while i >= len(self.items):
            if self.days >= MAX_PLANNED_NIGHTS:
                raise IndexError(i)
            self.days = min(MAX_PLANNED_NIGHTS, max(16, 2 * self.days))
            self.items = windows_between(self.schedule, self.at, self.at + timedelta(days=self.days))
        return self.items[i]

    def longest(self) -> float:
        """The longest window in the coming week (daylight-saving nights differ by an hour)."""
        week = windows_between(self.schedule, self.at, self.at + timedelta(days=8))
        return max((w.seconds for w in week), default=0.0)


def _stretch(
    job: QueuedJob, win: Interval, a: datetime, parts: list[tuple[str, float]], sched: ScheduleSpec
) -> _Stretch:
    secs = sum(s for _, s in parts)
    cost = _rate(job, sched) * secs
    return _Stretch(job.id, a, a + timedelta(seconds=secs), job.nodes, win, tuple(parts), cost)


def _rate(job: QueuedJob, sched: ScheduleSpec) -> float:
    """The job's off-peak cost per second (every stretch lies inside a window)."""
    return rates_per_s(_pricing(job, sched), job.gpus)[1]


def _pricing(job: QueuedJob, sched: ScheduleSpec) -> ScheduleSpec:
    """The queue's windows and zone with the job's own price and discount."""
    return sched.model_copy(
        update={
            "price_per_gpu_hour": job.schedule.price_per_gpu_hour,
            "offpeak_discount": job.schedule.offpeak_discount,
        }
    )


def _never_fits(job: QueuedJob, sched: ScheduleSpec, longest: float, max_nodes: int, budget: float | None) -> str:
    """Why no placement can ever hold the job ("" when one can)."""
    if job.nodes > max_nodes:
        return f"needs {plural(job.nodes, 'node')}; the queue has {max_nodes}"
    if job.steps < 1 or not (job.step_time_s > 0 and math.isfinite(job.step_time_s)):
        return f"nothing to plan: {job.steps} steps of {job.step_time_s} s"
    if job.policy == "wait":
        need = job.provisioning_s + job.training_s
        what = "provisioning + training"
    else:
        need = job.provisioning_s + job.restore_s + job.checkpoint_s + job.step_time_s
        what = "provisioning + restore + checkpoint + one step"
    if need > longest:
        fix = "; give it policy split" if job.policy == "wait" else ""
        return (
            f"a {job.policy} job's {what} ({hours_text(timedelta(seconds=need))}) is longer than any window "
            f"({hours_text(timedelta(seconds=longest))}): it never fits{fix}"
        )
    cost = _rate(job, sched) * need
    if budget is not None and cost > budget:
        return f"its {what} costs {cost:,.2f} a night, over the queue's budget per night ({budget:,.2f})"
    return ""


def _worth_training_s(job: QueuedJob, sched: ScheduleSpec, longest: float, budget: float | None) -> float:
    """The least training a stretch that is not the job's last must hold: as long as its overhead (provisioning,
    restore, checkpoint), unless even a whole window (or a whole night's budget) gives less; then one step."""
    overhead = job.provisioning_s + job.restore_s + job.checkpoint_s
    whole = longest if budget is None or _rate(job, sched) <= 0 else min(longest, budget / _rate(job, sched))
    most = math.floor(max(0.0, whole - overhead) / job.step_time_s) * job.step_time_s
    return overhead if most >= overhead else job.step_time_s


def _place(
    job: QueuedJob, board: _Board, wins: _Windows, at: datetime, sched: ScheduleSpec, worth_s: float
) -> list[_Stretch] | None:
    """The job's stretches at the earliest times the board leaves free; None when none within the horizon.
    A stretch that is not the last trains at least `worth_s` (a short gap is not worth a provisioning)."""
    rate = _rate(job, sched)
    left, out, after, i = job.steps, [], at, 0
    while left > 0:
        try:
            win = wins[i]
        except IndexError:
            return None
        placed = None
        for a in board.candidates(win, after):
            restore = job.restore_s if out else 0.0
            limit = board.free_until(a, job.nodes, win.end)
            money = board.money_left(win)
            if rate > 0 and math.isfinite(money):
                limit = min(limit, a + timedelta(seconds=max(0.0, money / rate)))
            room = (limit - a).total_seconds() - job.provisioning_s - restore
            if room >= left * job.step_time_s:  # the rest fits: the last stretch (no checkpoint)
                steps = left
                parts = [
                    ("provisioning", job.provisioning_s),
                    ("restore", restore),
                    ("training", steps * job.step_time_s),
                ]
            elif job.policy == "split":
                steps = math.floor(max(0.0, room - job.checkpoint_s) / job.step_time_s)
                if steps < 1 or steps * job.step_time_s < worth_s:  # too short to be worth renting for
                    continue
                parts = [
                    ("provisioning", job.provisioning_s),
                    ("restore", restore),
                    ("training", steps * job.step_time_s),
                    ("checkpoint", job.checkpoint_s),
                ]
            else:
                continue
            placed = _stretch(job, win, a, [p for p in parts if p[1] > 0], sched)
            left -= steps
            break
        if placed is None:
            i += 1
            continue
        board.place(placed)
        out.append(placed)
        after = placed.end
    return out


def _deadline_reason(job: QueuedJob, finish: datetime, solo: datetime | None, at: datetime, fmt) -> str:
    if job.deadline <= at:
        return f"its deadline {fmt(job.deadline)} is already past at {fmt(at)}"
    if solo is None or solo > job.deadline:
        alone = "cannot be planned" if solo is None else f"finishes {fmt(solo)}"
        return (
            f"even alone on the queue it {alone}, after its deadline {fmt(job.deadline)}: its "
            f"{job.hours:.2f} h of training do not fit the windows before then"
        )
    return (
        f"finishes {fmt(finish)}, after its deadline {fmt(job.deadline)}: jobs of higher priority (or an earlier "
        f"deadline) hold the nodes or the nightly budget first; alone it would finish {fmt(solo)}"
    )


def plan_queue(
    schedule: ScheduleSpec, max_nodes: int, jobs: list[QueuedJob], at: datetime, budget_per_night: float | None = None
) -> QueuePlan:
    """Pack `jobs` into the windows of `schedule` on `max_nodes` nodes from `at` (see the module's docstring)."""
    at = aware_utc(at, "at")
    if max_nodes < 1:
        raise ScheduleError(f"max_nodes must be >= 1, got {max_nodes}")
    if not schedule.windows:
        raise ScheduleError("a queue needs at least one window in its schedule")
    fmt = local_time_format(schedule.timezone)
    wins = _Windows(schedule, at)
    longest = wins.longest()
    board = _Board(max_nodes, budget_per_night)
    stretches: dict[int, list[_Stretch]] = {}
    reasons: dict[int, str] = {}
    ordered = sorted(jobs, key=QueuedJob.order)
    for job in ordered:
        why = _never_fits(job, schedule, longest, max_nodes, budget_per_night)
        worth = _worth_training_s(job, schedule, longest, budget_per_night)
        placed = None if why else _place(job, board, wins, at, schedule, worth)
        if placed is None:
            reasons[job.id] = why or f"no room within {MAX_PLANNED_NIGHTS} days of windows"
            continue
        stretches[job.id] = placed
        finish = placed[-1].end
        if job.deadline is not None and finish > job.deadline:
            alone = _place(job, _Board(max_nodes, budget_per_night), wins, at, schedule, worth)
            reasons[job.id] = _deadline_reason(job, finish, alone[-1].end if alone else None, at, fmt)
    nodes = _assign_nodes(board.stretches, {j.id: j.order() for j in jobs}, max_nodes)
    planned = []
    for job in ordered:
        segs: list[PlannedSegment] = []
        for st in stretches.get(job.id, []):
            t = st.start
            for what, secs in st.parts:
                end = t + timedelta(seconds=secs)
                cost = sum(p.cost for p in priced_segments(_pricing(job, schedule), t, end, job.gpus, what))
                segs.append(PlannedSegment(t, end, what, nodes[st.job_id, st.start], cost))
                t = end
        planned.append(PlannedJob(job, tuple(segs), reasons.get(job.id, "")))
    by_window: dict[datetime, Interval] = {s.window.start: s.window for s in board.stretches}
    nights = tuple(
        PlannedNight(
            w.start,
            w.end,
            sum(seg.cost for j in planned for seg in j.segments if w.start <= seg.start < w.end),
            budget_per_night,
        )
        for w in sorted(by_window.values(), key=lambda w: w.start)
    )
    return QueuePlan(at, schedule.timezone, schedule.currency, max_nodes, tuple(planned), nights)


def _assign_nodes(
    stretches: list[_Stretch], order: dict[int, tuple], max_nodes: int
) -> dict[tuple[int, datetime], tuple[int, ...]]:
    """Node indices for each stretch (keyed by job id and start): in start order, the nodes the job held in its
    previous stretch when they are all free, else the lowest-numbered free ones (the board kept the count under
    max_nodes at every instant, so there are always enough)."""
    out: dict[tuple[int, datetime], tuple[int, ...]] = {}
    last: dict[int, tuple[int, ...]] = {}
    active: list[tuple[datetime, tuple[int, ...]]] = []
    for st in sorted(stretches, key=lambda s: (s.start, order[s.job_id])):
        active = [(end, held) for end, held in active if end > st.start]
        busy = {n for _, held in active for n in held}
        free = [n for n in range(max_nodes) if n not in busy]
        if len(free) < st.nodes:  # pragma: no cover - the board prevents it
            raise ScheduleError(f"internal: {st.nodes} nodes wanted at {st.start.isoformat()}, {len(free)} free")
        before = last.get(st.job_id, ())
        nodes = before if before and not busy.intersection(before) else tuple(free[: st.nodes])
        out[st.job_id, st.start] = last[st.job_id] = nodes
        active.append((st.end, nodes))
    return out
