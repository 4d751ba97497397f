"""The attempt monitor (nightloom.attempt): lines and exit codes in, kill/stop decisions and the failure out.

No processes: times are given explicitly, and `watch` runs over a scripted launch.
"""

from __future__ import annotations

import threading
import time

from nightloom.attempt import DRAIN_S, PEER_EXIT_GRACE_S, AttemptMonitor, cause_line, scrub, watch
from nightloom.recovery import Watchdog


def monitor(collective_timeout_s: float = 5.0, startup_s: float = 100.0, started: float = 0.0) -> AttemptMonitor:
    dog = Watchdog(collective_timeout_s=collective_timeout_s, startup_timeout_s=startup_s, started=started)
    return AttemptMonitor(attempt=3, dog=dog)


def test_lines_are_scrubbed_kept_and_steps_fed_to_the_watchdog():
    m = monitor()
    assert m.line("[n0] env AWS_SECRET=abc hf_token=xyz key=k1 other=1", 0.0) == (
        "[n0] env AWS_SECRET=*** hf_token=*** key=*** other=1"
    )
    m.line("[n0] step 1/10 loss 5.0", 1.0)
    m.line("[n0] step 2/10 loss 4.9", 2.0)
    assert m.dog.last_step == 2 and m.dog.step_times == [1.0]
    for i in range(100):
        m.line(f"line {i}", 3.0)
    assert len(m.tail) == 60 and m.tail[-1] == "line 99"


def test_a_failed_node_gets_the_peer_grace_then_the_launch_is_killed_and_drained():
    m = monitor(collective_timeout_s=1000.0)
    assert m.tick({"n0": None, "n1": None}, 1.0) == "go"
    assert m.tick({"n0": None, "n1": 1}, 2.0) == "go"  # n1 failed first: the others get the grace
    assert m.first_failed == "n1"
    assert m.tick({"n0": 1, "n1": 1}, 2.0 + PEER_EXIT_GRACE_S) == "go"  # n0 exiting now does not move it
    assert m.first_failed == "n1"
    assert m.tick({"n0": None, "n1": 1}, 2.1 + PEER_EXIT_GRACE_S) == "kill"
    assert m.tick({}, 3.0 + PEER_EXIT_GRACE_S) == "go"  # draining
    assert m.tick({}, 2.2 + PEER_EXIT_GRACE_S + DRAIN_S) == "stop"
    assert not m.stalled


def test_a_silent_run_is_a_stall_with_its_silence():
    m = monitor(collective_timeout_s=5.0, startup_s=100.0)
    assert m.tick({}, 99.0) == "go"  # startup allowance
    m.line("[n0] step 1/10 loss 5.0", 99.0)
    assert m.tick({}, 103.0) == "go"
    assert m.tick({}, 105.5) == "kill" and m.stalled and m.silent_s == 6.5
    f = m.failure(rc=-9, at_unix=1234.0, now=106.0)
    assert f.stalled and f.exit_code is None and f.signal == "stall" and f.last_step == 1
    assert f.cause == "no new step for 6 s after step 1" and f.silent_s == 6.5 and f.attempt == 3
    assert m.describe(f) == "training attempt 3 stopped reporting: no new step for 6 s after step 1"


def test_failure_names_the_first_failed_nodes_signal_and_the_silence():
    m = monitor(collective_timeout_s=1000.0)
    m.line("[n0] step 4/10 loss 4.0", 10.0)
    m.line("[n0] RuntimeError: gloo timeout waiting for peers", 11.0)
    m.line("[n1] Signal 9 (SIGKILL) received by PID 123", 11.0)
    m.tick({"n0": None, "n1": -9}, 11.0)
    assert m.failure(rc=0, at_unix=0.0, now=12.0) is None  # exit 0, not stalled: no failure
    f = m.failure(rc=1, at_unix=50.0, now=14.0)
    assert f.exit_code == 1 and f.first_failed_node == "n1" and f.signal == "killed"
    assert f.cause == "[n1] Signal 9 (SIGKILL) received by PID 123" and f.silent_s == 4.0 and f.at_unix == 50.0
    assert m.describe(f).startswith("training attempt 3 exited with code 1: [n1] Signal 9")


def test_cause_line_prefers_the_first_failed_node_then_errors():
    tail = [
        "[a] ValueError: a's own error",
        "[b] exitcode  : 1 (pid: 7)",
        "[b] KeyError: later",
        "see https://pytorch.org/docs/stable/elastic/errors.html",
    ]
    assert cause_line(tail, "b") == "[b] exitcode  : 1 (pid: 7)"
    assert cause_line(tail, "a") == "[a] ValueError: a's own error"
    assert cause_line(tail, None) == "[b] KeyError: later"
    assert cause_line(["x", "an error happened", "done"], None) == "an error happened"
    assert cause_line(["x", "last"], None) == "last" and cause_line([], None) == "no output"
    assert scrub("password=hunter2 ok") == "password=*** ok"


class ScriptedLaunch:
    """A launch whose lines and exit codes follow a script; terminate ends its output."""

    def __init__(self, lines: list[str], codes: dict[str, int | None], rc: int, hang: bool = False):
        self._lines, self.codes, self.rc, self.hang = lines, codes, rc, hang
        self.terminated = threading.Event()
        self.pids: list[int] = []

    def lines(self):
        yield from self._lines
        if self.hang:
            self.terminated.wait(30)

    def poll(self):
        return dict(self.codes)

    def wait(self, timeout=None):
        return self.rc

    def terminate(self):
        self.terminated.set()


class Log:
    def __init__(self):
        self.info_lines, self.warnings = [], []

    def info(self, fmt, *args):
        self.info_lines.append(fmt % args)

    def warning(self, fmt, *args):
        self.warnings.append(fmt % args)


def test_watch_streams_scrubbed_lines_and_returns_the_exit_code():
    launch = ScriptedLaunch(["[n0] token=s3cr3t", "[n0] step 1/2 loss 1.0"], {"n0": 0}, rc=0)
    log, m = Log(), monitor(started=time.monotonic())
    assert watch(launch, m, log, poll_s=0.01) == 0
    assert log.info_lines == ["[n0] token=***", "[n0] step 1/2 loss 1.0"] and launch.terminated.is_set()
    assert "s3cr3t" not in "".join(log.info_lines) and m.dog.last_step == 1


def test_watch_kills_a_stalled_launch_and_reports_minus_one():
    launch = ScriptedLaunch(["[n0] step 1/9 loss 1.0"], {"n0": None}, rc=0, hang=True)
    log, m = Log(), monitor(collective_timeout_s=0.2, startup_s=0.2, started=time.monotonic())
    assert watch(launch, m, log, poll_s=0.05) == -1
    assert m.stalled and launch.terminated.is_set()
    assert len(log.warnings) == 1 and "stopped reporting" in log.warnings[0]
