"""The trackers' credentials from Prefect Secret blocks (track.mlflow.token_secret, track.wandb.api_key_secret):
into the ranks' launch environment (tasks/train.py) and, while the run's end is logged, the flow's own."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from nightloom.spec.tracking import TrackSpec
from nightloom.track.records import secret_env


def prefect_secret(name: str) -> str:
    from prefect.blocks.system import Secret

    return str(Secret.load(name).get())


def tracker_secrets(track: TrackSpec) -> dict[str, str]:
    """MLFLOW_TRACKING_TOKEN / WANDB_API_KEY from the blocks `track` names ({} when it names none)."""
    return secret_env(track, prefect_secret)


@contextmanager
def secrets_in_env(track: TrackSpec) -> Iterator[None]:
    """The blocks' credentials in this process's environment for the block's duration, then as they were."""
    values = tracker_secrets(track)
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
