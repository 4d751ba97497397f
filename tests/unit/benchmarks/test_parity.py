"""nightloom's benchmark scores (`nightloom eval RUN --tasks ...` on the run's export) equal lm-eval run by hand:
`lm_eval.simple_evaluate` called here, in the task folder, on the same Hugging Face folder with the same tasks and
settings, to 1e-6, for a multiple-choice task (acc, acc_norm) and a generative one (exact_match) from a local task
folder. The eval command's usage errors."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from flows.cli import main
from nightloom.benchmarks.harness import OFFLINE, model_args
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


@pytest.mark.slow
def test_scores_equal_lm_eval_by_hand(tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    run_dir = tmp_path / "run"  # a run folder: its job file and its export
    model = tiny_model(run_dir / "export")
    (run_dir / "job.json").write_text("{}")
    pairs = qa_pairs(24)
    folder = write_tasks(tmp_path / "tasks", pairs, _greedy_answers(model, pairs, 12))
    cli = ["eval", str(run_dir), "--tasks", f"{MC_TASK},{GEN_TASK}", "--include-path", str(folder), "--limit", "20"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*cli, "--json"]) == 0
    ours = {(r["task"], r["metric"]): r for r in json.loads(buf.getvalue())}

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
    for (task, metric), r in ours.items():
        assert r["tuned"] == pytest.approx(hand[task][f"{metric},none"], abs=1e-6), (task, metric)
        assert r["stderr"] == pytest.approx(hand[task][f"{metric}_stderr,none"], abs=1e-6), (task, metric)
        assert r["samples"] == 20 and r["base"] is None
    assert 0 < ours[(GEN_TASK, "exact_match")]["tuned"] < 1, ours  # the generative score is not a trivial 0 or 1
    assert 0 < ours[(MC_TASK, "acc")]["tuned"] < 1
    assert by_hand["n-shot"] == {MC_TASK: 1, GEN_TASK: 0}
    assert model_args(str(model), None)["dtype"] == "float32"  # what nightloom passed on this CPU machine


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ([], "give --data FILE (held-out loss) or --tasks T1,T2"),
        (["--data", "x.jsonl", "--tasks", "a"], "one of them"),
        (["--tasks", "a"], "the run's export"),
    ],
)
def test_eval_tasks_usage_errors(tmp_path, capsys, args, words):
    (tmp_path / "job.json").write_text("{}")
    assert main(["eval", str(tmp_path), *args]) == 2
    assert words in capsys.readouterr().err
