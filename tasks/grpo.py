"""train.task grpo's artifact: the last table of sampled completions with their rewards (nightloom/train/rollout/
table.py, written by rank 0 every train.grpo.log_completions_every steps) as a Prefect table artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from nightloom.train.rollout.table import latest_table


@task(name="grpo-completions", cache_policy=NO_CACHE)
def completions_artifact_task(run_dir: str) -> int | None:
    """The run's newest completions table as the `grpo-completions` artifact; its step, or None if none was written."""
    table = latest_table(run_dir)
    if table is None:
        return None
    desc = f"Sampled completions and their rewards at step {table.step}"
    create_table_artifact(key="grpo-completions", table=table.rows, description=desc)
    return table.step
