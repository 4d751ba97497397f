"""Train task: write the TrainJob, launch torchrun on every node through the provider, stream its output."""

from __future__ import annotations

import os
import re
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom.provision.base import Cluster, Provider
from nightloom.train.job import TrainJob, TrainResult
from nightloom.util import atomic_write_text
from tasks.teardown import record_processes


class TrainingFailed(RuntimeError):
    """torchrun exited non-zero, or ended without the result it must write."""


_SECRETISH = re.compile(r"(?i)(secret|password|token|key)=\S+")


def write_job(job: TrainJob) -> Path:
    path = Path(job.run_dir) / f"job-attempt{job.attempt}.json"
    atomic_write_text(path, job.model_dump_json(indent=2))
    return path


@task(name="train", cache_policy=NO_CACHE)
def train_task(provider: Provider, cluster: Cluster, job: TrainJob) -> TrainResult:
    """Run training on the cluster; every output line goes to the run log; fail with the cause on error."""
    log = get_run_logger()
    job_path = write_job(job)
    if Path(job.result_path).exists():
        os.remove(job.result_path)  # a stale result must never be mistaken for this attempt's
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launch = provider.launch(cluster, ["-m", "nightloom.train", "--job", str(job_path)], env)
    if getattr(launch, "pids", None):
        record_processes(Path(job.run_dir), list(launch.pids))
    tail: list[str] = []
    try:
        for line in launch.lines():
            line = _SECRETISH.sub(r"\1=***", line)
            log.info("%s", line)
            tail = (tail + [line])[-30:]
        rc = launch.wait()
    finally:
        launch.terminate()
    if rc != 0:
        cause = next((t for t in reversed(tail) if "Error" in t or "error" in t), tail[-1] if tail else "no output")
        raise TrainingFailed(f"training exited with code {rc}: {cause}")
    if not Path(job.result_path).is_file():
        raise TrainingFailed(f"training exited 0 but wrote no result at {job.result_path}")
    result = TrainResult.model_validate_json(Path(job.result_path).read_text())
    log.info("training %s after %d/%d steps, final loss %s", result.stopped, result.steps_done,
             result.total_steps, result.final_loss)
    return result
