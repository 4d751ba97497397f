"""nightloom.benchmarks.answer_task: the grpo-demo's generative task, built on first use from held-out prompts with
their `answer` column (read through the shard manifest's text field), its two metrics, and lm-eval loading the
folder it writes (the `!function` metrics shim) and scoring with them."""

from __future__ import annotations

import json

import pytest

from nightloom.benchmarks.answer_task import answer_docs, completion_scores, ensure_answer_task
from nightloom.benchmarks.demo_task import heldout_split, heldout_texts
from nightloom.benchmarks.stage import ensure_task, prompts_for
from nightloom.spec.benchmarks import BenchmarksSpec


def _shards(folder, rows: list[dict], text_field: str, keep: list[str]):
    """A shard folder's manifest and held-out Parquet as the shard stage writes them (the fields read here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "heldout.x.parquet")
    manifest = {"heldout": {"path": "heldout.x.parquet", "rows": len(rows)}, "text_field": text_field}
    (folder / "manifest.json").write_text(json.dumps(manifest | {"keep_columns": keep}))
    return folder


@pytest.mark.parametrize(
    "completion, answer, exact, digits",
    [
        ("6", "6", 1.0, 1.0),
        ("6abc", "6", 1.0, 0.25),
        ("56", "6", 0.0, 1.0),
        ("", "6", 0.0, 0.0),
        ("12x", "12", 1.0, 2 / 3),
    ],
)
def test_metrics_read_a_completion_as_the_reward_does(completion, answer, exact, digits):
    assert completion_scores(completion, answer) == {"exact_match": exact, "digits": pytest.approx(digits)}


def test_heldout_prompts_and_answers_through_the_manifest(tmp_path):
    rows = [{"prompt": "ab: 1+2=", "answer": "3"}, {"prompt": "c: 4+4=", "answer": "8"}, {"prompt": "", "answer": "1"}]
    shards = _shards(tmp_path / "s", rows, "prompt", ["answer"])
    held = heldout_split(shards)
    assert held == {"text": ["ab: 1+2=", "c: 4+4=", ""], "answer": ["3", "8", "1"]}
    assert heldout_texts(shards) == ["ab: 1+2=", "c: 4+4="] and heldout_split(tmp_path / "none") == {}
    assert answer_docs(held["text"], held["answer"]) == [rows[0], rows[1]]
    settings = BenchmarksSpec(tasks=["g"], include_path=str(tmp_path / "t"), demo_task="g", max_new_tokens=5)
    ensure_task(settings, held)  # prompts with answers: the generative task, not the multiple-choice one
    assert "output_type: generate_until" in (tmp_path / "t" / "g.yaml").read_text()
    assert "max_gen_toks: 5" in (tmp_path / "t" / "g.yaml").read_text()
    assert prompts_for(settings.model_copy(update={"completions": 1}), held) == ["ab: 1+2="]
    chats = _shards(tmp_path / "c", [{"text": "<|im_start|>user\nq?<|im_end|>"}], "text", [])
    assert prompts_for(settings, heldout_split(chats)) == []  # a chat without an answer turn: no prompt


def test_the_folder_is_built_once_and_refused_without_answers(tmp_path):
    assert ensure_answer_task(tmp_path, "g", ["a: 1+1="], ["2"], 6) == 1
    assert ensure_answer_task(tmp_path, "g", ["b: 2+2="], ["4"], 6) is None  # kept: the base's cache stays valid
    assert [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()] == [
        {"prompt": "a: 1+1=", "answer": "2"}
    ]
    with pytest.raises(ValueError, match="demo_task 'g': no held-out prompt with an 'answer'"):
        ensure_answer_task(tmp_path / "empty", "g", ["a: 1+1="], [""], 6)
    assert not (tmp_path / "empty" / "g.yaml").exists()


def test_lm_eval_loads_the_task_and_scores_with_its_metrics(tmp_path, monkeypatch):
    """lm-eval's own loader on the folder (offline, run in it as launch.py does): the task's config, its documents
    and the metrics its `!function` shim brings in."""
    from nightloom.benchmarks.catalog import task_errors, task_manager

    ensure_answer_task(tmp_path, "g", ["a: 1+1=", "b: 2+2="], ["2", "4"], 6)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert task_errors(["g"], str(tmp_path)) == []
    task = task_manager(["g"], str(tmp_path)).load(["g"])["tasks"]["g"]
    assert task.OUTPUT_TYPE == "generate_until" and task.config.generation_kwargs["max_gen_toks"] == 6
    docs = list(task.test_docs())
    assert [task.doc_to_text(d) for d in docs] == ["a: 1+1=", "b: 2+2="]
    assert task.process_results(docs[1], ["4x"]) == {"exact_match": 1.0, "digits": 0.5}
    assert set(task.aggregation()) == {"exact_match", "digits"}
