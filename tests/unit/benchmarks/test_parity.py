"""nightloom's benchmark scores equal lm-eval run by hand: `lm_eval.simple_evaluate` called here, in the task
folder, on the same Hugging Face folder with the same tasks and settings, to 1e-6, for a multiple-choice task
(acc, acc_norm) and a generative one (exact_match) from a local task folder."""

from __future__ import annotations

import os

import pytest

from nightloom.benchmarks.harness import OFFLINE, model_args, simple_evaluate_kwargs
from nightloom.benchmarks.launch import make_job, run_process
from nightloom.spec.benchmarks import BenchmarksSpec
from tests.support.benchmarks import GEN_TASK, MC_TASK, qa_pairs, tiny_model, write_tasks


def _greedy_answers(model_dir, pairs, k: int) -> list[str]:
    """The model's own greedy continuation of the first k prompts (so exact_match is not 0), the rest a miss."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for i, (q, _) in enumerate(pairs):
        if i >= k:
            out.append("never said")
            continue
        ids = tok(f"Q: {q}\nA:", return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        out.append(tok.decode(gen[0, ids.shape[1] :]).split("\n")[0])
    return out


def test_scores_equal_lm_eval_by_hand(tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = tiny_model(tmp_path / "export")
    pairs = qa_pairs(24)
    folder = write_tasks(tmp_path / "tasks", pairs, _greedy_answers(model, pairs, 12))
    settings = BenchmarksSpec(tasks=[MC_TASK, GEN_TASK], include_path=str(folder), limit=20)
    job = make_job(settings, None, [], tmp_path / "work" / "out.json")
    job.models = [str(model)]
    (tmp_path / "work").mkdir()
    ours = {(s.task, s.metric): s for s in run_process(job, tmp_path / "work")[0].scores}

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(folder)  # lm-eval reads relative data_files from the current folder
    by_hand = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(model), "device": "cpu", "dtype": "float32"},
        tasks=[MC_TASK, GEN_TASK],
        limit=20,
        batch_size=8,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
    )
    hand = by_hand["results"]
    assert set(ours) == {(MC_TASK, "acc"), (MC_TASK, "acc_norm"), (GEN_TASK, "exact_match")}, ours
    for (task, metric), s in ours.items():
        assert s.value == pytest.approx(hand[task][f"{metric},none"], abs=1e-6), (task, metric)
        assert s.stderr == pytest.approx(hand[task][f"{metric}_stderr,none"], abs=1e-6), (task, metric)
        assert s.samples == 20
    assert 0 < ours[(GEN_TASK, "exact_match")].value < 1, ours  # the generative score is not a trivial 0 or 1
    assert 0 < ours[(MC_TASK, "acc")].value < 1
    assert by_hand["n-shot"] == {MC_TASK: 1, GEN_TASK: 0}
    assert model_args(str(model), None)["dtype"] == "float32" and simple_evaluate_kwargs(job)["limit"] == 20
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
