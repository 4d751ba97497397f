"""Train task: write the TrainJob, launch torchrun on every node through the provider, stream its output.

One call is one attempt. While streaming it watches for the failures recovery acts on (tasks/recovery.py):
a node whose processes exit non-zero (the others get a short grace to exit, then everything is killed) and
a run that stops reporting (nightloom.recovery.Watchdog). A failure raises TrainingFailed carrying an
AttemptFailure (exit code, stall, cause line, last step, first node to fail).
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom.provision.base import Cluster, Provider
from nightloom.recovery import STARTUP_TIMEOUT_S, AttemptFailure, Watchdog, parse_step
from nightloom.train.job import TrainJob, TrainResult
from nightloom.util import atomic_write_text
from tasks.teardown import record_processes


class TrainingFailed(RuntimeError):
    """torchrun exited non-zero, stopped reporting, or ended without the result it must write.
    `failure` (an AttemptFailure) says how, for recovery."""

    failure: AttemptFailure | None = None


_SECRETISH = re.compile(r"(?i)(secret|password|token|key)=\S+")
#: once one node has failed, the others get this long to exit by themselves (their errors are the cause)
PEER_EXIT_GRACE_S = 10.0
#: after killing a launch, how long its output may still drain
DRAIN_S = 30.0


def write_job(job: TrainJob) -> Path:
    path = Path(job.run_dir) / f"job-attempt{job.attempt}.json"
    atomic_write_text(path, job.model_dump_json(indent=2))
    return path


def node_codes(launch) -> dict[str, int | None]:
    """Exit code per node so far (Launch.poll; launches without it report nothing until they end)."""
    return dict(launch.poll()) if callable(getattr(launch, "poll", None)) else {}


def _pump(launch, q: queue.Queue) -> None:
    try:
        for line in launch.lines():
            q.put(line)
    finally:
        q.put(None)


_SIGNAL = re.compile(r"Signal \d+ \(\w+\) received by PID \d+|exitcode\s*:\s*-?\d+ \(pid: \d+\)")
_ERROR = re.compile(r"\b\w*(Error|Exception)\b: \S")


def _cause(tail: list[str], first_failed: str | None) -> str:
    """The most telling line: a signal/exit code of the first node to fail, else the last `XError: ...`."""
    mine = [t for t in tail if first_failed and t.startswith(f"[{first_failed}]")]
    for pool, pattern in ((mine, _SIGNAL), (mine, _ERROR), (tail, _ERROR), (tail, _SIGNAL)):
        hit = next((t for t in reversed(pool) if pattern.search(t)), None)
        if hit:
            return hit.strip()
    return next(
        (t for t in reversed(tail) if "error" in t.lower() and "errors.html" not in t),
        tail[-1] if tail else "no output",
    )


@task(name="train", cache_policy=NO_CACHE)
def train_task(
    provider: Provider, cluster: Cluster, job: TrainJob, startup_timeout_s: float | None = None
) -> TrainResult:
    """Run training on the cluster; every output line goes to the run log; fail with the cause on error.
    `startup_timeout_s`: how long the first step may take to appear (recovery passes its time left)."""
    log = get_run_logger()
    job_path = write_job(job)
    if Path(job.result_path).exists():
        os.remove(job.result_path)  # a stale result must never be mistaken for this attempt's
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    dog = Watchdog(
        collective_timeout_s=float(job.train.collective_timeout_s),
        startup_timeout_s=startup_timeout_s or STARTUP_TIMEOUT_S,
        checkpoint_every=job.train.checkpoint_every,
        started=time.monotonic(),
    )
    launch = provider.launch(cluster, ["-m", "nightloom.train", "--job", str(job_path)], env)
    if getattr(launch, "pids", None):
        record_processes(Path(job.run_dir), list(launch.pids))
    q: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(launch, q), daemon=True, name="train-output").start()
    tail: list[str] = []
    first_failed: str | None = None
    failed_at = killed_at = None
    stalled, silent = False, 0.0
    try:
        while True:
            try:
                line = q.get(timeout=0.5)
            except queue.Empty:
                line = ""
            if line is None:
                break
            now = time.monotonic()
            if line:
                line = _SECRETISH.sub(r"\1=***", line)
                log.info("%s", line)
                tail = (tail + [line])[-60:]
                step = parse_step(line)
                if step is not None:
                    dog.step(step, now)
            if killed_at is not None:
                if now - killed_at > DRAIN_S:
                    break
                continue
            if first_failed is None:
                bad = [n for n, c in node_codes(launch).items() if c not in (None, 0)]
                if bad:
                    first_failed, failed_at = bad[0], now
            over = dog.overdue(now)
            if over is not None:
                stalled, silent = True, over
                log.warning(
                    "no progress for %.0f s (allowed %.0f s): the run stopped reporting; killing it",
                    over,
                    dog.allowance(),
                )
            if stalled or (failed_at is not None and now - failed_at > PEER_EXIT_GRACE_S):
                launch.terminate()
                killed_at = now
        rc = launch.wait(timeout=60) if not stalled else -1
    except TimeoutError:
        rc = -1
    finally:
        launch.terminate()
    detected = time.time()
    if stalled or rc != 0:
        cause = f"no new step for {silent:.0f} s after step {dog.last_step}" if stalled else _cause(tail, first_failed)
        err = TrainingFailed(
            f"training attempt {job.attempt} "
            + ("stopped reporting" if stalled else f"exited with code {rc}")
            + f": {cause}"
        )
        err.failure = AttemptFailure(
            attempt=job.attempt,
            exit_code=None if stalled else rc,
            stalled=stalled,
            cause=cause,
            last_step=dog.last_step,
            first_failed_node=first_failed,
            at_unix=detected,
            silent_s=silent if stalled else (time.monotonic() - dog.last_at if dog.last_at else 0.0),
        )
        raise err
    if not Path(job.result_path).is_file():
        err = TrainingFailed(f"training exited 0 but wrote no result at {job.result_path}")
        err.failure = AttemptFailure(
            attempt=job.attempt, exit_code=0, stalled=False, cause=str(err), last_step=dog.last_step, at_unix=detected
        )
        raise err
    result = TrainResult.model_validate_json(Path(job.result_path).read_text())
    log.info(
        "training %s after %d/%d steps, final loss %s",
        result.stopped,
        result.steps_done,
        result.total_steps,
        result.final_loss,
    )
    return result
