"""Off-peak windows and the run-now/wait/split decision at one instant.

Windows are daily local times in the schedule's time zone (zoneinfo): a window whose end is not after its
start crosses midnight. Each occurrence is turned into UTC instants, so durations are real elapsed time on
daylight-saving days (a 01:00–05:00 window lasts 5 h on the night clocks fall back). A local start that does
not exist (skipped by a spring-forward) resolves as zoneinfo does for fold=0: shifted by the jump.
Every function takes the current time as an argument (an injected clock); none reads the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Literal
from zoneinfo import ZoneInfo

from nightloom.schedule.errors import ScheduleError
from nightloom.spec import ScheduleSpec


@dataclass(frozen=True)
class Interval:
    """One concrete window occurrence, [start, end) as aware UTC datetimes."""

    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def aware_utc(now: datetime, what: str = "now") -> datetime:
    """`now` in UTC; a naive datetime is refused (ScheduleError), never guessed."""
    if now.tzinfo is None or now.utcoffset() is None:
        raise ScheduleError(f"{what} must be timezone-aware, got naive {now.isoformat()}")
    return now.astimezone(UTC)


def parse_zoned(text: str | None, what: str) -> datetime | None:
    """An ISO time given by a user (`--at`, `--deadline`, a flow's `at`), which must carry its time zone offset;
    None for None. ValueError naming `what` for a naive time, never guessed."""
    if text is None:
        return None
    t = datetime.fromisoformat(text)
    if t.tzinfo is None:
        raise ValueError(f"{what} needs a time zone offset, e.g. 2026-06-01T01:30:00+08:00, got {text!r}")
    return t


def _hhmm(s: str) -> time:
    h, m = s.split(":")
    return time(int(h), int(m))


def occurrences(schedule: ScheduleSpec, day: date) -> list[Interval]:
    """The windows that start on local date `day`, in UTC (a midnight-crossing one ends the next day)."""
    tz = ZoneInfo(schedule.timezone)
    out = []
    for w in schedule.windows:
        s, e = _hhmm(w.start), _hhmm(w.end)
        start = datetime.combine(day, s, tzinfo=tz)
        end = datetime.combine(day + timedelta(days=1) if e <= s else day, e, tzinfo=tz)
        out.append(Interval(start.astimezone(UTC), end.astimezone(UTC)))
    return out


def windows_between(schedule: ScheduleSpec, start: datetime, end: datetime) -> list[Interval]:
    """Window occurrences overlapping [start, end), merged where they touch or overlap, in order."""
    start, end = aware_utc(start, "start"), aware_utc(end, "end")
    tz = ZoneInfo(schedule.timezone)
    d0 = start.astimezone(tz).date() - timedelta(days=1)
    d1 = end.astimezone(tz).date() + timedelta(days=1)
    raw: list[Interval] = []
    d = d0
    while d <= d1:
        raw += [iv for iv in occurrences(schedule, d) if iv.end > start and iv.start < end and iv.end > iv.start]
        d += timedelta(days=1)
    raw.sort(key=lambda iv: iv.start)
    merged: list[Interval] = []
    for iv in raw:
        if merged and iv.start <= merged[-1].end:
            if iv.end > merged[-1].end:
                merged[-1] = Interval(merged[-1].start, iv.end)
        else:
            merged.append(iv)
    return merged


def current_window(schedule: ScheduleSpec, now: datetime) -> Interval | None:
    """The (merged) window containing `now`, or None."""
    now = aware_utc(now)
    for iv in windows_between(schedule, now - timedelta(days=2), now + timedelta(days=2)):
        if iv.start <= now < iv.end:
            return iv
    return None


def next_window(schedule: ScheduleSpec, now: datetime) -> Interval:
    """The first (merged) window starting strictly after `now`."""
    now = aware_utc(now)
    if not schedule.windows:
        raise ScheduleError("schedule.windows is empty")
    for iv in windows_between(schedule, now, now + timedelta(days=3)):
        if iv.start > now:
            return iv
    raise ScheduleError(f"no window starts within 3 days of {now.isoformat()} (windows cover the whole day)")


# ---------------------------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class WindowDecision:
    """What the gate does: `run` now (maybe with a checkpoint `deadline`) or `wait` until `start_at`."""

    action: Literal["run", "wait"]
    policy: str
    reason: str
    now: datetime
    start_at: datetime  # == now when action is "run"
    deadline: datetime | None = None  # split: checkpoint and stop here (the window end)
    window: Interval | None = None  # the window the run starts in, if any
    predicted_end: datetime | None = None  # start_at + predicted duration (ignoring splits)

    @property
    def wait_s(self) -> float:
        return (self.start_at - self.now).total_seconds()


def decide(now: datetime, schedule: ScheduleSpec, predicted_duration_s: float) -> WindowDecision:
    """The off-peak gate. `run-now`: always run. `wait`: run inside a window when the run fits in what is left
    of it, else wait for the next window start (a run longer than any window starts at a window start, or now
    if already inside one). `split`: run inside a window with the window end as the checkpoint deadline,
    else wait for the next window start."""
    now = aware_utc(now)
    if predicted_duration_s < 0 or not math.isfinite(predicted_duration_s):
        raise ScheduleError(f"predicted_duration_s must be finite and >= 0, got {predicted_duration_s}")
    dur = timedelta(seconds=predicted_duration_s)
    pol = schedule.policy
    if pol == "run-now":
        win = current_window(schedule, now) if schedule.windows else None
        where = "inside" if win else "outside"
        return WindowDecision(
            "run", pol, f"policy run-now: starting now ({where} the off-peak window)", now, now, None, win, now + dur
        )
    if not schedule.windows:
        raise ScheduleError(f"policy {pol!r} needs at least one window in schedule.windows")
    win = current_window(schedule, now)
    fmt = local_time_format(schedule.timezone)
    try:
        nxt = next_window(schedule, now)
    except ScheduleError:  # windows cover the whole day: there is no "next start"
        assert win is not None
        return WindowDecision(
            "run", pol, f"policy {pol}: the windows cover the whole day; starting now", now, now, None, win, now + dur
        )
    if pol == "split":
        return _split(now, pol, dur, win, nxt, fmt)
    return _wait(now, pol, schedule, dur, win, nxt, fmt)


def _split(now: datetime, pol: str, dur: timedelta, win: Interval | None, nxt: Interval, fmt) -> WindowDecision:
    """Policy split: run inside a window with its end as the checkpoint deadline, else wait for the next start."""
    if win is not None:
        fits = now + dur <= win.end
        why = "fits before it" if fits else "will checkpoint there and resume in the next window"
        return WindowDecision(
            "run",
            pol,
            f"policy split: inside the window until {fmt(win.end)}; {why}",
            now,
            now,
            win.end,
            win,
            now + dur,
        )
    return WindowDecision(
        "wait",
        pol,
        f"policy split: outside the window; next starts {fmt(nxt.start)}",
        now,
        nxt.start,
        None,
        nxt,
        nxt.start + dur,
    )


def _wait(
    now: datetime, pol: str, schedule: ScheduleSpec, dur: timedelta, win: Interval | None, nxt: Interval, fmt
) -> WindowDecision:
    """Policy wait: run inside a window when the run fits in what is left of it (or is longer than any window),
    else wait for the next window start."""
    if win is not None and now + dur <= win.end:
        return WindowDecision(
            "run",
            pol,
            f"policy wait: inside the window; the run ({hours_text(dur)}) ends before {fmt(win.end)}",
            now,
            now,
            None,
            win,
            now + dur,
        )
    longest = max(_longest_window(schedule, now), nxt.seconds)
    if win is not None and dur.total_seconds() > longest:
        return WindowDecision(
            "run",
            pol,
            f"policy wait: the run ({hours_text(dur)}) is longer than any window "
            f"({hours_text(timedelta(seconds=longest))}); starting now, inside the window, it overruns "
            f"{fmt(win.end)}",
            now,
            now,
            None,
            win,
            now + dur,
        )
    if win is not None:
        reason = (
            f"policy wait: the run ({hours_text(dur)}) does not fit in what is left of this window (ends "
            f"{fmt(win.end)}); next window starts {fmt(nxt.start)}"
        )
    else:
        reason = f"policy wait: outside the off-peak window; next starts {fmt(nxt.start)}"
    return WindowDecision("wait", pol, reason, now, nxt.start, None, nxt, nxt.start + dur)


def _longest_window(schedule: ScheduleSpec, now: datetime) -> float:
    return max((iv.seconds for iv in windows_between(schedule, now, now + timedelta(days=2))), default=0.0)


def local_time_format(timezone: str) -> Callable[[datetime], str]:
    """A formatter of instants in `timezone`, e.g. '2026-12-03 05:12 CST'."""
    tz = ZoneInfo(timezone)
    return lambda t: t.astimezone(tz).strftime("%Y-%m-%d %H:%M %Z")


def hours_text(d: timedelta) -> str:
    """A duration in hours, for reasons: '4.00 h'."""
    return f"{d.total_seconds() / 3600:.2f} h"
