"""Benchmarks on a GPU: the lm-eval process puts the model on CUDA in its checkpoint's dtype, and its scores equal
lm_eval.simple_evaluate by hand with the same arguments (the CPU parity test's check, on the device)."""

from __future__ import annotations

import pytest

from nightloom.benchmarks.harness import OFFLINE, model_args
from nightloom.benchmarks.launch import make_job, run_process
from nightloom.spec.benchmarks import BenchmarksSpec
from tests.support.benchmarks import GEN_TASK, MC_TASK, qa_pairs, tiny_model, write_tasks

pytestmark = pytest.mark.gpu  # tests/conftest.py skips every gpu-marked test without CUDA


def test_scores_on_cuda_equal_lm_eval_by_hand(tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = tiny_model(tmp_path / "export")
    folder = write_tasks(tmp_path / "tasks", qa_pairs(16))
    args = model_args(str(model), None)
    assert args["device"] == "cuda" and args["dtype"] == "auto", args
    job = make_job(BenchmarksSpec(tasks=[MC_TASK, GEN_TASK], include_path=str(folder)), None, [], tmp_path / "o.json")
    job.models = [str(model)]
    ours = {(s.task, s.metric): s.value for s in run_process(job, tmp_path)[0].scores}
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(folder)
    hand = lm_eval.simple_evaluate(
        model="hf",
        model_args=args,
        tasks=[MC_TASK, GEN_TASK],
        batch_size=8,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
    )["results"]
    for (task, metric), value in ours.items():
        assert value == pytest.approx(hand[task][f"{metric},none"], abs=1e-6), (task, metric)
