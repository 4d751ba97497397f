"""One training attempt, watched: the rules that turn a launch's output lines and exit codes into an outcome.

`AttemptMonitor` is fed lines and per-node exit codes with the time they were seen (no clock, no
processes of its own), and says when to kill the launch: the run stopped reporting (`Watchdog`), or a
node failed and its peers had `PEER_EXIT_GRACE_S` to exit by themselves (their errors are the cause).
After a kill the output may drain for `DRAIN_S`. `failure(rc)` then names how the attempt ended
(an `AttemptFailure` for recovery), with the most telling output line as its cause.

`watch(launch, monitor, log)` runs the monitor over a live launch (a thread pumps its lines).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from nightloom.provision.base import Launch
from nightloom.recovery import STARTUP_TIMEOUT_S, AttemptFailure, Watchdog, parse_step

#: once one node has failed, the others get this long to exit by themselves (their errors are the cause)
PEER_EXIT_GRACE_S = 10.0
#: after killing a launch, how long its output may still drain
DRAIN_S = 30.0
#: output lines kept for finding the cause
TAIL_LINES = 60

_SECRETISH = re.compile(r"(?i)(secret|password|token|key)=\S+")
_SIGNAL = re.compile(r"Signal \d+ \(\w+\) received by PID \d+|exitcode\s*:\s*-?\d+ \(pid: \d+\)")
#: a Python exception's message line ("torch.distributed.DistNetworkError: ...", "[n1] ValueError: ...")
EXCEPTION_LINE = re.compile(r"\b\w*(Error|Exception)\b: \S")

Action = Literal["go", "kill", "stop"]


def scrub(line: str) -> str:
    """`name=value` for secret-looking names (secret, password, token, key) with the value masked."""
    return _SECRETISH.sub(r"\1=***", line)


def cause_line(tail: list[str], first_failed: str | None) -> str:
    """The most telling line: a signal/exit code of the first node to fail, else the last `XError: ...`."""
    mine = [t for t in tail if first_failed and t.startswith(f"[{first_failed}]")]
    for pool, pattern in ((mine, _SIGNAL), (mine, EXCEPTION_LINE), (tail, EXCEPTION_LINE), (tail, _SIGNAL)):
        hit = next((t for t in reversed(pool) if pattern.search(t)), None)
        if hit:
            return hit.strip()
    return next(
        (t for t in reversed(tail) if "error" in t.lower() and "errors.html" not in t),
        tail[-1] if tail else "no output",
    )


@dataclass
class AttemptMonitor:
    """The state of one attempt as its output arrives; every method takes the (monotonic) time it is called."""

    attempt: int
    dog: Watchdog
    tail: list[str] = field(default_factory=list)
    first_failed: str | None = None
    failed_at: float | None = None
    killed_at: float | None = None
    stalled: bool = False
    silent_s: float = 0.0

    @classmethod
    def for_job(cls, job, startup_timeout_s: float | None, started: float) -> AttemptMonitor:
        """A monitor with the job's collective timeout and checkpoint interval (TrainJob)."""
        dog = Watchdog(
            collective_timeout_s=float(job.train.collective_timeout_s),
            startup_timeout_s=startup_timeout_s or STARTUP_TIMEOUT_S,
            checkpoint_every=job.train.checkpoint_every,
            started=started,
        )
        return cls(attempt=job.attempt, dog=dog)

    def line(self, line: str, now: float) -> str:
        """Take one output line; return it scrubbed of secrets (what may be logged)."""
        line = scrub(line)
        self.tail = (self.tail + [line])[-TAIL_LINES:]
        step = parse_step(line)
        if step is not None:
            self.dog.step(step, now)
        return line

    def tick(self, codes: dict[str, int | None], now: float) -> Action:
        """Given the exit codes so far: go on reading, kill the launch now, or stop reading (drained)."""
        if self.killed_at is not None:
            return "stop" if now - self.killed_at > DRAIN_S else "go"
        if self.first_failed is None:
            bad = [n for n, c in codes.items() if c not in (None, 0)]
            if bad:
                self.first_failed, self.failed_at = bad[0], now
        over = self.dog.overdue(now)
        if over is not None:
            self.stalled, self.silent_s = True, over
        if self.stalled or (self.failed_at is not None and now - self.failed_at > PEER_EXIT_GRACE_S):
            self.killed_at = now
            return "kill"
        return "go"

    def failure(self, rc: int, at_unix: float, now: float) -> AttemptFailure | None:
        """How the attempt failed given the launch's exit code, or None when it exited 0 without stalling."""
        if not self.stalled and rc == 0:
            return None
        if self.stalled:
            cause = f"no new step for {self.silent_s:.0f} s after step {self.dog.last_step}"
        else:
            cause = cause_line(self.tail, self.first_failed)
        last_at = self.dog.last_at
        return AttemptFailure(
            attempt=self.attempt,
            exit_code=None if self.stalled else rc,
            stalled=self.stalled,
            cause=cause,
            last_step=self.dog.last_step,
            first_failed_node=self.first_failed,
            at_unix=at_unix,
            silent_s=self.silent_s if self.stalled else (now - last_at if last_at else 0.0),
        )

    def describe(self, failure: AttemptFailure) -> str:
        """One line for the error: the attempt, how it ended, the cause."""
        how = "stopped reporting" if failure.stalled else f"exited with code {failure.exit_code}"
        return f"training attempt {self.attempt} {how}: {failure.cause}"


def _pump(launch: Launch, q: queue.Queue) -> None:
    try:
        for line in launch.lines():
            q.put(line)
    finally:
        q.put(None)


def watch(launch: Launch, mon: AttemptMonitor, log, poll_s: float = 0.5) -> int:
    """Stream `launch` through `mon` (each scrubbed line to `log.info`), kill it when `mon` says so;
    return its exit code (-1 when stalled or when it did not exit). The launch is terminated in any case."""
    q: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(launch, q), daemon=True, name="train-output").start()
    try:
        while True:
            try:
                line = q.get(timeout=poll_s)
            except queue.Empty:
                line = ""
            if line is None:
                break
            now = time.monotonic()
            if line:
                log.info("%s", mon.line(line, now))
            action = mon.tick(launch.poll() if mon.killed_at is None else {}, now)
            if action == "stop":
                break
            if action == "kill":
                if mon.stalled:
                    log.warning(
                        "no progress for %.0f s (allowed %.0f s): the run stopped reporting; killing it",
                        mon.silent_s,
                        mon.dog.allowance(),
                    )
                launch.terminate()
        return launch.wait(timeout=60) if not mon.stalled else -1
    except TimeoutError:
        return -1
    finally:
        launch.terminate()
