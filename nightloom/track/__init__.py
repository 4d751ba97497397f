"""Experiment trackers (the spec's `track`: MLflow, Weights & Biases, TensorBoard). Its modules, one job each:

- records.py: TrackerStatus (a tracker's run, rows sent and lost), tracking.json (TrackingFile), `scrub`;
- sink.py: TrackerSink, a step sink that buffers and delivers from a background thread (never stalls training);
- mlflow_run.py, wandb_run.py, tensorboard_run.py: one client per tracker;
- attempt.py: rank 0's sinks for one training attempt;
- finish.py: the flow's end of the run: the resolved spec and plan as parameters, verdicts, plots and summary.
"""
