"""Train task: write the TrainJob, launch torchrun on every node through the provider, stream its output.

One call is one attempt. The rules that watch it (secret scrubbing, stall watchdog, peer-exit grace, kill and
drain, the cause line) are nightloom.attempt's; a failure raises TrainingFailed carrying an AttemptFailure
(exit code, stall, cause line, last step, first node to fail) for recovery (tasks/recovery.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom.attempt import AttemptMonitor, watch
from nightloom.provision.base import Cluster, Provider
from nightloom.recovery import AttemptFailure
from nightloom.train.job import TrainJob, TrainResult
from nightloom.train.preempt import PREEMPTED, Forward
from nightloom.util import atomic_write_text
from tasks.teardown import record_processes
from tasks.track import tracker_secrets


class TrainingFailed(RuntimeError):
    """torchrun exited non-zero, stopped reporting, or ended without the result it must write.
    `failure` (an AttemptFailure) says how, for recovery."""

    failure: AttemptFailure | None = None

    @classmethod
    def of(cls, message: str, failure: AttemptFailure) -> TrainingFailed:
        err = cls(message)
        err.failure = failure
        return err


def write_job(job: TrainJob) -> Path:
    """The attempt's job file (every rank reads it); a stale result.json is removed so it is never mistaken
    for this attempt's."""
    path = job.files.job(job.attempt)
    atomic_write_text(path, job.model_dump_json(indent=2))
    if job.result_path.exists():
        os.remove(job.result_path)
    return path


def rank_env(job: TrainJob, preempt_grace_s: int) -> dict[str, str]:
    """The ranks' environment: one thread each, unbuffered output, and torchrun told which signals to pass on
    (SIGTERM and the preempt signal) and how long to wait for the ranks to save."""
    signals = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *([job.preempt_signal] if job.preempt_signal else [])]
    return {
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(signals),
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(preempt_grace_s),
    }


@task(name="train", cache_policy=NO_CACHE)
def train_task(
    provider: Provider,
    cluster: Cluster,
    job: TrainJob,
    startup_timeout_s: float | None = None,
    preempt_grace_s: int = 120,
) -> TrainResult:
    """Run training on the cluster; every output line goes to the run log; fail with the cause on error.
    `startup_timeout_s`: how long the first step may take to appear (recovery passes its time left). A preempted
    attempt (every rank saved at one step, result.json says so, whatever torchrun's exit code) is returned.
    torchrun forwards SIGTERM and the preempt signal to its ranks and gives them `preempt_grace_s` to save."""
    log = get_run_logger()
    job_path = write_job(job)
    mon = AttemptMonitor.for_job(job, startup_timeout_s, started=time.monotonic())
    env = rank_env(job, preempt_grace_s) | tracker_secrets(job.track)  # track: credentials from Secret blocks
    log.info(
        "launching attempt %d on %s: %d rank(s), layout %s, steps %d (ranks import torch and build the model first)",
        job.attempt,
        cluster.name,
        job.plan.world_size,
        job.plan.layout(),
        job.train.steps,
    )
    launch = provider.launch(cluster, ["-m", "nightloom.train", "--job", str(job_path)], env)
    if launch.pids:
        record_processes(Path(job.run_dir), list(launch.pids))
    with Forward.to(launch):  # the orchestrator's own SIGTERM or Ctrl-C: the ranks save and stop
        rc = watch(launch, mon, log)
    preempted = _result(job) if job.result_path.is_file() else None
    if preempted is not None and preempted.stopped == PREEMPTED:
        log.warning(
            "training attempt %d preempted at step %d/%d (exit %d): checkpoint %s",
            job.attempt,
            preempted.steps_done,
            preempted.total_steps,
            rc,
            preempted.last_checkpoint,
        )
        return preempted
    failure = mon.failure(rc, at_unix=time.time(), now=time.monotonic())
    if failure is not None:
        raise TrainingFailed.of(mon.describe(failure), failure)
    if not job.result_path.is_file():
        msg = f"training exited 0 but wrote no result at {job.result_path}"
        last = mon.dog.last_step
        raise TrainingFailed.of(msg, AttemptFailure(job.attempt, 0, False, msg, last, at_unix=time.time()))
    result = _result(job)
    log.info(
        "training %s after %d/%d steps, final loss %s",
        result.stopped,
        result.steps_done,
        result.total_steps,
        "n/a" if result.final_loss is None else f"{result.final_loss:.4f}",
    )
    return result


def _result(job: TrainJob) -> TrainResult:
    return TrainResult.model_validate_json(job.result_path.read_text())
