"""XTuner backend tasks: thin Prefect wrappers around nightloom.finetune (env, data prep, launch + stream, convert).

The pipeline calls `xtuner_train_task` when `train.backend == "xtuner"` (one task, the whole backend). The stage
tasks wrap one stage each, for a flow that wants them as separate task runs (the pipeline does not use them).
Output lines go to the Prefect run log.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom.finetune import XTunerEnv, XTunerPlan, XTunerResult, ensure_env, run_xtuner
from nightloom.finetune.run import convert_checkpoint, launch_training, plan_xtuner, prepare_data, write_step_metrics
from nightloom.spec import RunSpec


def _log():
    logger = get_run_logger()
    return logger.info


@task(name="xtuner-env", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10)
def xtuner_env_task(python: str | None = None) -> XTunerEnv:
    """Find (seconds) or build (minutes, once per requirements hash) the XTuner node environment."""
    return ensure_env(python=python, log=_log())


@task(name="xtuner-prepare", cache_policy=NO_CACHE)
def xtuner_prepare_task(spec: RunSpec, manifest, run_dir: str, world_size: int, env: XTunerEnv) -> XTunerPlan:
    """Check inputs, render the config, tokenize + pack the shards; fails before launch on bad input."""
    log = _log()
    plan = plan_xtuner(spec, manifest, run_dir, world_size=world_size, env=env, log=log)
    stats = prepare_data(plan, log=log)
    log(f"xtuner: processed dataset: {stats}")
    return plan


@task(name="xtuner-launch", cache_policy=NO_CACHE)
def xtuner_launch_task(plan: XTunerPlan, cluster=None, provider=None, resume: bool = True) -> Path:
    """Train (streamed into the run log); write metrics.jsonl; return the final checkpoint."""
    ckpt = launch_training(plan, cluster=cluster, provider=provider, resume=resume, log=_log())
    write_step_metrics(plan)
    return ckpt


@task(name="xtuner-convert", cache_policy=NO_CACHE)
def xtuner_convert_task(
    plan: XTunerPlan, checkpoint: Path, publish_to: str | None = None, s3_endpoint_url: str | None = None
) -> dict:
    """pth → Hugging Face (LoRA merged when asked), then publish to storage."""
    return convert_checkpoint(plan, checkpoint, log=_log(), publish_to=publish_to, s3_endpoint_url=s3_endpoint_url)


@task(name="train-xtuner", cache_policy=NO_CACHE)
def xtuner_train_task(spec: RunSpec, manifest, run_dir: str, cluster=None, provider=None) -> XTunerResult:
    """The whole XTuner backend in one task: env → prepare → launch → metrics → convert → publish."""
    return run_xtuner(spec, manifest, run_dir, cluster=cluster, log=_log(), provider=provider)
