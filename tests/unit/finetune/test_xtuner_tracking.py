"""XTuner's logged steps to the trackers (nightloom.finetune.track_feed): mmengine's records become the step
reporter's StepRecords under the names a native run sends, each step once (again when a relaunch redid it), and a
real TensorBoard tracker ends with metrics.jsonl's values."""

from __future__ import annotations

import json
from pathlib import Path

from nightloom.finetune.logs import RunShape, collect_steps, write_metrics
from nightloom.finetune.track_feed import XTunerStepFeed, fed_trackers, step_record
from nightloom.metrics import read_metrics
from nightloom.spec.tracking import TrackSpec
from nightloom.track.attempt import AttemptTrackers
from nightloom.track.records import TrackingFile
from nightloom.track.sink import STEP_FIELDS, step_values
from nightloom.train.reporting import StepRecord, StepReporter

SHAPE = RunShape(tokens_per_step=256, flops_per_token=6e6, n_devices=2, peak_flops_per_device=1e12)


def launch(work: Path, stamp: str, rows: list[dict]) -> None:
    """One mmengine launch folder with its vis_data/scalars.json, as XTuner writes it."""
    d = work / stamp / "vis_data"
    d.mkdir(parents=True)
    (d / "scalars.json").write_text("".join(json.dumps(r) + "\n" for r in rows))


def row(step: int, loss: float) -> dict:
    return {"lr": 1e-3 / step, "data_time": 0.01, "loss": loss, "time": 0.5, "grad_norm": 0.9, "memory": 300.0,
            "iter": step, "step": step}  # fmt: skip


class Kept:
    """A step sink that keeps what it was given (the reporter's other end, as a tracker sees it)."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def emit(self, record: StepRecord) -> None:
        self.records.append(record)


def test_an_xtuner_step_has_the_native_names_and_no_invented_figures(tmp_path: Path):
    launch(tmp_path, "20260101_000000", [row(1, 5.25), row(2, 4.5)])
    m = collect_steps(tmp_path, SHAPE)[1]
    values = step_values(step_record(m, total_steps=4, world_size=2, now=123.0)).values
    assert set(values) <= set(STEP_FIELDS)
    assert values == {
        "loss": 4.5,
        "grad_norm": 0.9,
        "lr": 5e-4,
        "tokens_per_s": 512.0,
        "step_time_s": 0.5,
        "mfu": m.mfu,
        "peak_mem_bytes": 300.0 * 2**20,
    }
    assert 0 < m.mfu < 1  # 512 tok/s × 6e6 FLOPs / (2 × 1e12)
    rec = step_record(m, total_steps=4, world_size=2, now=123.0)
    assert (rec.step, rec.total_steps, rec.time, rec.world_size, rec.hfu, rec.label_tokens_per_s) == (
        2, 4, 123.0, 2, None, None)  # fmt: skip


def test_each_step_is_sent_once_and_again_when_a_relaunch_redid_it(tmp_path: Path):
    work, run_dir = tmp_path / "work", tmp_path / "run"
    run_dir.mkdir()
    kept, reporter = Kept(), StepReporter()
    reporter.add(kept)
    feed = XTunerStepFeed(AttemptTrackers(TrackSpec(), run_dir, "r"), reporter, work, SHAPE, total_steps=4)
    assert feed.poll() == 0  # no launch yet: nothing, no error
    launch(work, "20260101_000000", [row(1, 5.0), row(2, 4.0), row(3, 3.5)])
    assert feed.poll() == 3 and feed.poll() == 0
    launch(work, "20260101_000100", [row(3, 3.25), row(4, 3.0)])  # resumed from step 2: step 3 redone
    assert feed.poll() == 2
    assert [(r.step, r.loss, r.gap) for r in kept.records] == [
        (1, 5.0, False), (2, 4.0, False), (3, 3.5, False), (3, 3.25, True), (4, 3.0, False)]  # fmt: skip
    write_metrics(work, run_dir / "metrics.jsonl", SHAPE)
    feed.final = read_metrics(run_dir / "metrics.jsonl")
    assert feed.finish() == [] and len(kept.records) == 5  # metrics.jsonl holds nothing the sink lacks


def test_a_tensorboard_tracker_ends_with_metrics_jsonl_values(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    work, run_dir = tmp_path / "work", tmp_path / "run"
    run_dir.mkdir()
    track = TrackSpec.model_validate({"tensorboard": {}, "flush_s": 10})
    launch(work, "20260101_000000", [row(1, 5.0), row(2, 4.0)])
    with fed_trackers(track, run_dir, "r", work, SHAPE, total_steps=3) as feed:
        launch(work, "20260101_000100", [row(2, 3.75), row(3, 3.5)])
        write_metrics(work, run_dir / "metrics.jsonl", SHAPE)
        feed.final = read_metrics(run_dir / "metrics.jsonl")
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    last = {e.step: e.value for e in acc.Scalars("train/loss")}  # a redone step's later value last
    assert last == {m.step: m.loss for m in feed.final} == {1: 5.0, 2: 3.75, 3: 3.5}
    assert {f"train/{k}" for k in ("lr", "grad_norm", "tokens_per_s", "mfu")} <= set(acc.Tags()["scalars"])
    (status,) = TrackingFile.load(run_dir).attempts[-1]
    assert (status.tracker, status.lost, status.error) == ("tensorboard", 0, None) and status.sent >= 3
