"""validate.benchmarks: what the schema refuses, and what validate refuses before anything is rented (an
unknown task name; a task whose dataset needs the network and is not cached), each named with FILE:LINE."""

from __future__ import annotations

import pytest
import yaml

from nightloom.spec import RunSpec, SpecError
from nightloom.spec.load import load_spec
from tests.support.benchmarks import MC_TASK, qa_pairs, write_tasks


def _bench(**kw) -> dict:
    return {"name": "b", "dataset": {"path": "/d.jsonl"}, "validate": {"benchmarks": kw}}


@pytest.mark.parametrize(
    ("bench", "words"),
    [
        ({"tasks": []}, "at least 1 item"),
        ({"tasks": ["a"], "fewshot_as_multiturn": True}, "needs apply_chat_template"),
        ({"tasks": ["a"], "gates": [{"task": "b", "min": 0.5}]}, "gates[0].task 'b' is not one of tasks"),
        ({"tasks": ["a"], "gates": [{"task": "a"}]}, "needs min, min_gain or max_drop"),
        ({"tasks": ["a"], "base": False, "gates": [{"task": "a", "max_drop": 0.1}]}, "compare with the base"),
        ({"tasks": ["a"], "limit": 2.5}, "a count"),
    ],
)
def test_the_schema_refuses(bench, words):
    with pytest.raises(ValueError, match=None) as err:
        RunSpec.model_validate(_bench(**bench))
    assert words in str(err.value), str(err.value)


def test_unknown_task_and_network_dataset_are_refused_at_validate(tmp_path):
    folder = write_tasks(tmp_path / "tasks", qa_pairs(4))
    (folder / "hub.yaml").write_text("task: nl_hub\ndataset_path: someorg/never-downloaded\ndataset_name: main\n")
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    data = _bench(tasks=[MC_TASK, "nl_mcq", "nl_hub"], include_path="tasks")
    data["dataset"]["path"] = "d.jsonl"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    text = "\n".join(err.value.errors)
    assert f"{path}:6: validate.benchmarks.tasks.1: unknown task 'nl_mcq'" in text, text
    assert "close: nl_mc" in text, text
    assert "validate.benchmarks.tasks.2: task 'nl_hub' needs dataset 'someorg/never-downloaded' (main)" in text, text
    assert "tasks.0" not in text, text  # the local task is fine
    data["validate"]["benchmarks"]["tasks"] = [MC_TASK]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_spec(path).validate_.benchmarks.include_path == str(folder)  # resolved against the spec


def test_a_gate_against_the_base_needs_base_weights(tmp_path):
    write_tasks(tmp_path / "tasks", qa_pairs(4))
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    gates = [{"task": MC_TASK, "metric": "acc", "min": 0.1}, {"task": MC_TASK, "metric": "acc", "max_drop": 0.1}]
    data = _bench(tasks=[MC_TASK], include_path="tasks", gates=gates)
    data["dataset"]["path"] = "d.jsonl"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    [line] = err.value.errors
    assert "validate.benchmarks.gates.1: min_gain and max_drop compare with the base: the run has no model.weights" in (
        line
    )


def test_a_hub_dataset_already_in_the_local_cache_is_accepted(tmp_path, monkeypatch):
    from datasets import config

    from nightloom.benchmarks.catalog import task_errors

    folder = write_tasks(tmp_path / "tasks", qa_pairs(4))
    (folder / "hub.yaml").write_text("task: nl_hub\ndataset_path: someorg/downloaded-once\n")
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", tmp_path / "cache")
    [(index, reason)] = task_errors(["nl_hub"], str(folder))
    assert index == 0 and "needs dataset 'someorg/downloaded-once'" in reason
    (tmp_path / "cache" / "someorg___downloaded-once").mkdir(parents=True)  # as datasets caches it
    assert task_errors(["nl_hub", MC_TASK], str(folder)) == []
