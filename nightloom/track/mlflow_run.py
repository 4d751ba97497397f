"""An MLflow run through MlflowClient (mlflow-skinny): metrics in batches (log_batch), the flow's parameters,
artifacts, tags and its end. MLflow's own HTTP retries are turned off in this process
(MLFLOW_HTTP_REQUEST_MAX_RETRIES=0, a short MLFLOW_HTTP_REQUEST_TIMEOUT, unless set): its default retries for
minutes inside one call, where the sink's thread retries by itself and the end of training must not wait on it.
Credentials come from MLflow's own environment variables (MLFLOW_TRACKING_TOKEN, _USERNAME/_PASSWORD) only."""

from __future__ import annotations

import os
from pathlib import Path

from nightloom.spec.tracking import MLflowTrack
from nightloom.track.sink import StepValues

BATCH_METRICS = 1000  # MLflow's limit per log_batch request
BATCH_PARAMS = 100
PARAM_CHARS = 6000  # MLflow's limit on a parameter's value


class MLflowRun:
    name = "mlflow"

    def __init__(self, settings: MLflowTrack, run_name: str, run_id: str | None = None, timeout_s: float = 5.0):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(timeout_s))))
        from mlflow.tracking import MlflowClient

        self.where = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not self.where:
            raise ValueError("track.mlflow: no tracking_uri, and MLFLOW_TRACKING_URI is not set")
        self.client = MlflowClient(tracking_uri=self.where)
        self.experiment, self.run_name, self.run_id = settings.experiment, run_name, run_id

    def open(self) -> str:
        if self.run_id is not None:
            self.client.get_run(self.run_id)  # reachable, and the run is there
            return self.run_id
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                exp_id = self.client.create_experiment(self.experiment)
            except Exception:  # another run created it meanwhile
                exp_id = self.client.get_experiment_by_name(self.experiment).experiment_id
        else:
            exp_id = exp.experiment_id
        run = self.client.create_run(exp_id, run_name=self.run_name, tags={"nightloom.run_id": self.run_name})
        self.run_id = run.info.run_id
        return self.run_id

    def log_metrics(self, rows: list[StepValues]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(key=k, value=v, timestamp=int(r.time * 1000), step=r.step) for r in rows for k, v in r.values.items()
        ]
        for i in range(0, len(metrics), BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + BATCH_METRICS])

    def close(self) -> None:
        """Nothing held client-side: log_batch is synchronous."""

    # -- the flow's end-of-run logging

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=items[i : i + BATCH_PARAMS])

    def log_values(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, 0, step) for k, v in values.items()])

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, v)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, succeeded: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if succeeded else "FAILED")
