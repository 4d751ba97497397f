"""The spec's `track` section: the experiment trackers a run reports to (MLflow, Weights & Biases, TensorBoard), each
with its own settings. `track: [mlflow, wandb]` turns trackers on with their defaults. No credential is ever a
setting here: MLflow's token or password and W&B's API key come from the environment (or a Prefect Secret block
named here, read by the flow), and a tracking URI holding a password is refused."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from nightloom.spec.base import Section as _Section

TRACKERS = ("mlflow", "wandb", "tensorboard")


class MLflowTrack(_Section):
    tracking_uri: str | None = Field(
        None,
        description="The MLflow tracking server (http://host:5000) or a local store (file:/path); None: "
        "MLFLOW_TRACKING_URI from the environment. Never with a password: MLFLOW_TRACKING_TOKEN, or "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, in the environment.",
    )
    experiment: str = Field("nightloom", description="The experiment the run goes in (created if missing).")
    token_secret: str | None = Field(
        None, description="Prefect Secret block whose value is the tracking server's token (MLFLOW_TRACKING_TOKEN)."
    )

    @field_validator("tracking_uri")
    @classmethod
    def _no_password(cls, v: str | None) -> str | None:
        if v and urlsplit(v).password:
            raise ValueError(
                "holds a password: give it in the environment (MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN) "
                "or a Prefect Secret block (token_secret), never in the spec"
            )
        return v


class WandbTrack(_Section):
    project: str = Field("nightloom", description="The W&B project.")
    entity: str | None = Field(None, description="The W&B team or user; None: the API key's default.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: the run's files are written under the run folder (wandb/), to `wandb sync` later; "
        "online: sent as it goes (WANDB_API_KEY in the environment, or api_key_secret).",
    )
    api_key_secret: str | None = Field(None, description="Prefect Secret block whose value is WANDB_API_KEY.")


class TensorBoardTrack(_Section):
    folder: str = Field(
        "tensorboard", description="Where the event files go: relative to the run folder, or an absolute path."
    )


class TrackSpec(_Section):
    """Trackers on (a section) or off (None); every step's metrics go to each through the trainer's step reporter."""

    mlflow: MLflowTrack | None = Field(None, description="MLflow: a run per training run, its id in the ledger.")
    wandb: WandbTrack | None = Field(None, description="Weights & Biases: a run per training run.")
    tensorboard: TensorBoardTrack | None = Field(None, description="TensorBoard event files.")
    flush_s: float = Field(
        30.0,
        ge=0,
        description="How long the end of training waits for a tracker that is down or slow to take what is "
        "buffered; what it has not taken by then is said in the summary as lost.",
    )

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data):
        """`[mlflow, wandb]`: those trackers with their defaults."""
        if isinstance(data, list | tuple):
            unknown = [n for n in data if n not in TRACKERS]
            if unknown:
                raise ValueError(f"unknown tracker(s) {unknown}: choose from {list(TRACKERS)}")
            return {name: {} for name in data}
        return data

    def enabled(self) -> list[str]:
        """The trackers turned on, in TRACKERS' order."""
        return [n for n in TRACKERS if getattr(self, n) is not None]


def track_errors(data: dict, environ: dict[str, str]) -> list[tuple[tuple, str]]:
    """The `track` checks that need the environment, at validate (spec.checks): an MLflow tracker with no server
    named nowhere. (field path, reason) pairs on the raw mapping."""
    track = data.get("track")
    if isinstance(track, list):
        mlflow = {} if "mlflow" in track else None
    else:
        mlflow = track.get("mlflow") if isinstance(track, dict) else None
    if isinstance(mlflow, dict) and not mlflow.get("tracking_uri") and not environ.get("MLFLOW_TRACKING_URI"):
        return [(("track", "mlflow", "tracking_uri"), "not set, and MLFLOW_TRACKING_URI is not in the environment")]
    return []
