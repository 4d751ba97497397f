"""Preemption notices on a rank: SIGTERM (and the job's `preempt_signal`, e.g. Slurm's SIGUSR1) only note their
name; the run loop agrees on it with every rank at the next step boundary, saves a checkpoint there and stops
with `stopped="preempted"` and the exit code PREEMPTED_EXIT. No torch import: the orchestrator reads it too."""

from __future__ import annotations

import signal
from contextlib import contextmanager

#: a rank's exit code after a preemption notice, once its checkpoint is saved (EX_TEMPFAIL: run it again)
PREEMPTED_EXIT = 75
#: TrainResult.stopped of a preempted attempt
PREEMPTED = "preempted"


class Preemption:
    """The notice this process got (the signal's name), or None."""

    received: str | None = None

    @classmethod
    def install(cls, extra: str | None) -> None:
        """Handle SIGTERM and `extra` (e.g. "SIGUSR1"); a no-op off the main thread (several jobs in one launch)."""

        def note(signum, _frame) -> None:
            cls.received = cls.received or signal.Signals(signum).name

        for name in ("SIGTERM", *([extra] if extra else [])):
            try:
                signal.signal(getattr(signal, name), note)
            except ValueError:  # not the main thread
                return


class Forward:
    """The orchestrator's side: while an attempt runs, its own SIGTERM or Ctrl-C (SIGINT) is passed on to the
    launch (`launch.notify()` where the provider has one: SIGTERM to the ranks, which save and stop; else
    `terminate()`), and remembered in `requested` so recovery does not relaunch: `nightloom run --resume`
    continues from the checkpoint."""

    requested: str | None = None
    launch: object | None = None

    @classmethod
    def notice(cls, signum: int) -> None:
        """Called from the orchestrator's signal handler: remember, and pass the notice to the running launch."""
        cls.requested = cls.requested or signal.Signals(signum).name
        launch = cls.launch
        if launch is not None:
            notify = getattr(launch, "notify", None)
            (notify or launch.terminate)()

    @classmethod
    @contextmanager
    def to(cls, launch):
        """Forward notices to `launch` inside the block (and at once, if one came before it started)."""
        cls.launch = launch
        try:
            if cls.requested is not None:
                cls.notice(getattr(signal, cls.requested))
            yield
        finally:
            cls.launch = None

    @classmethod
    @contextmanager
    def installed(cls):
        """Handle SIGTERM and SIGINT in this (main) thread as notices for the inside of the block."""
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for s in old:
                signal.signal(s, lambda signum, _f: cls.notice(signum))
        except ValueError:  # not the main thread: leave the handlers as they are
            old = {}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            cls.requested = None
