"""The errors of the schedule package: a question with no answer, and a run refused before anything is rented."""

from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule question that has no answer (naive datetime, no windows for a windowed policy...)."""


class StepTimeUnknown(ScheduleError):
    """No source gives the run's step time (the planner predicts none on CPU, the ledger has no measurement): the
    caller must give the hours (`--hours`), a usage error."""


class RunRefused(RuntimeError):
    """A run refused before anything is rented (over budget, too many nights); the message says why."""


class BudgetExceeded(RunRefused):
    """The predicted cost of a run is above the spec's budget; the message gives both figures."""


class TooManyNights(RunRefused):
    """A run needs more nights than schedule.max_nights; the message gives the number it needs."""
