"""The XTuner backend as one Prefect task: a thin wrapper around nightloom.finetune.run.run_xtuner.

The pipeline calls `xtuner_train_task` when `train.backend == "xtuner"` (env → prepare → train with recovery →
metrics → convert → publish); output lines go to the Prefect run log.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from nightloom.finetune.run import XTunerResult, run_xtuner
from nightloom.spec import RunSpec
from tasks.track import secrets_in_env


@task(name="train-xtuner", cache_policy=NO_CACHE)
def xtuner_train_task(spec: RunSpec, manifest, run_dir: str, cluster=None, provider=None) -> XTunerResult:
    """The whole XTuner backend in one task: env → prepare → launch → metrics → convert → publish."""
    with secrets_in_env(spec.track):  # track: the trackers' credentials from Prefect Secret blocks, while it trains
        return run_xtuner(spec, manifest, run_dir, cluster=cluster, log=get_run_logger().info, provider=provider)
