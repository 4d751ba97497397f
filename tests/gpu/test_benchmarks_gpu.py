"""Benchmarks on a GPU: the lm-eval process puts the model on CUDA in its checkpoint's dtype, and its scores equal
lm_eval.simple_evaluate by hand with the same arguments (the CPU parity test's check, on the device); a model
spread over two GPUs (lm-eval's HF model parallelism) scores as on one; the vLLM backend where vllm is installed."""

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
    settings = BenchmarksSpec(tasks=[MC_TASK, GEN_TASK], include_path=str(folder), backend="hf")
    job = make_job(settings, None, [], tmp_path / "o.json")
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


def _job(tmp_path, folder, backend: str = "hf"):
    return make_job(
        BenchmarksSpec(tasks=[MC_TASK], include_path=str(folder), backend=backend), None, [], tmp_path / "o"
    )


def test_a_model_spread_over_the_gpus_scores_as_on_one(tmp_path, monkeypatch):
    """lm-eval's HF model parallelism (parallelize=True), chosen when the weights pass the headroom of one GPU (here
    made 0), gives the one-device scores."""
    import torch

    from nightloom.benchmarks import engine
    from nightloom.benchmarks.harness import evaluate

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs to spread over")
    model = tiny_model(tmp_path / "export")
    folder = write_tasks(tmp_path / "tasks", qa_pairs(16))
    monkeypatch.chdir(folder)
    one = {(s.task, s.metric): s.value for s in evaluate(str(model), _job(tmp_path, folder))}
    monkeypatch.setattr(engine, "HEADROOM", 0.0)
    assert engine.node_engine(str(model), "hf").parallelize
    spread = {(s.task, s.metric): s.value for s in evaluate(str(model), _job(tmp_path, folder))}
    assert spread == pytest.approx(one, abs=1e-4)


def test_the_vllm_backend_scores_the_export(tmp_path):
    """backend: vllm runs lm-eval's vLLM backend in the lm-eval process (tensor parallel 1 for a tiny model); its
    multiple-choice accuracy is the HF backend's but for near ties (a tiny random model's logits)."""
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        pytest.skip("vllm is not installed here")
    model = tiny_model(tmp_path / "export")
    folder = write_tasks(tmp_path / "tasks", qa_pairs(16))
    scores = {}
    for backend in ("hf", "vllm"):
        job = _job(tmp_path, folder, backend)
        job.models = [str(model)]
        scores[backend] = {(s.task, s.metric): s.value for s in run_process(job, tmp_path)[0].scores}
    assert "lm-eval's vllm backend" in (tmp_path / "benchmarks.log").read_text()
    assert scores["vllm"] == pytest.approx(scores["hf"], abs=2 / 16)
