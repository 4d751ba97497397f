"""train.task grpo and train.grpo: TRL's defaults, and every setting, layout or reward function that cannot be used
refused at validate naming the field (FILE:LINE through load_spec), before anything is rented."""

from __future__ import annotations

import pytest
import yaml

from nightloom.spec import RunSpec, SpecError
from nightloom.spec.grpo import GRPOSpec
from nightloom.spec.load import load_spec


def _write(tmp_path, grpo: dict | None = None, parallel="auto", **train) -> object:
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    (tmp_path / "mine.py").write_text(
        "def good(prompts, completions, **row):\n    return [0.0] * len(completions)\n\n"
        "def no_row(prompts, completions):\n    return []\n"
    )
    data = {
        "name": "g",
        "dataset": {"path": str(corpus)},
        "train": {"task": "grpo", **({"grpo": grpo} if grpo is not None else {}), **train},
        "parallel": parallel,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_defaults_are_trls_and_a_plain_spec_keeps_its_hash(tmp_path):
    g = GRPOSpec()
    assert (g.beta, g.loss_type, g.epsilon, g.clip_high, g.scale_rewards, g.temperature) == (
        0.0,
        "dapo",
        0.2,
        0.2,
        "group",
        1.0,
    )
    assert [r.fn for r in g.rewards] == ["accuracy"]
    base = {"name": "p", "dataset": {"path": "/d.jsonl"}}
    assert RunSpec.model_validate(base).spec_hash() == RunSpec.model_validate({**base, "train": {}}).spec_hash()
    spec = load_spec(_write(tmp_path, {"rewards": [{"fn": "mine.py:good", "weight": 2}], "epsilon_high": 0.28}))
    assert spec.train.grpo.clip_high == 0.28 and spec.train.grpo.rewards[0].weight == 2


@pytest.mark.parametrize(
    ("grpo", "parallel", "field", "words"),
    [
        ({}, {"pp": 2}, "", "parallel.pp: 2: train.task grpo generates inside the training ranks"),
        ({}, {"cp": 2}, "", "parallel.cp: 2"),
        ({}, {"tp": 2, "sp": True}, "", "parallel.sp: true: train.task grpo's rollouts"),
        ({"beta": 0.04}, "auto", "", "train.grpo.beta: 0.04: the KL term's reference is the base with the adapters"),
        ({"epsilon": 0.3, "epsilon_high": 0.2}, "auto", "train.grpo", "epsilon_high: 0.2 is below epsilon"),
        ({"loss_type": "bnpo"}, "auto", "train.grpo.loss_type", "'grpo', 'dr_grpo' or 'dapo'"),
        ({"num_generations": 1}, "auto", "train.grpo.num_generations", "greater than or equal to 2"),
        ({"rewards": []}, "auto", "train.grpo.rewards", "at least 1 item"),
        ({"rewards": [{"fn": "accurate"}]}, "auto", "train.grpo.rewards.0.fn", "expected a built-in"),
        ({"rewards": [{"fn": "mine.py:nothing"}]}, "auto", "train.grpo.rewards.0.fn", "has no function 'nothing'"),
        ({"rewards": [{"fn": "mine.py:no_row"}]}, "auto", "train.grpo.rewards.0.fn", "must accept **row"),
        ({"rewards": [{"fn": "gone.py:f"}]}, "auto", "train.grpo.rewards.0.fn", "no file"),
        ({"rewards": [{"fn": "format"}]}, "auto", "train.grpo.rewards.0.fn", "missing ['pattern']"),
        ({"rewards": [{"fn": "no_such_pkg_xyz.mod:f"}]}, "auto", "train.grpo.rewards.0.fn", "importing module"),
    ],
)
def test_what_grpo_refuses_is_named_at_validate(tmp_path, grpo, parallel, field, words):
    path = _write(tmp_path, grpo, parallel)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    text = "\n".join(err.value.errors)
    assert words in text and str(path) in text, text
    if field:
        assert f": {field}:" in text, text


def test_the_grpo_section_needs_task_grpo():
    with pytest.raises(ValueError, match="train.grpo: applies to train.task: grpo only"):
        RunSpec.model_validate({"name": "p", "dataset": {"path": "/d.jsonl"}, "train": {"grpo": {}}})
    with pytest.raises(ValueError, match="grpo runs on the native backend only"):
        RunSpec.model_validate(
            {"name": "p", "dataset": {"path": "/d.jsonl"}, "train": {"task": "grpo", "backend": "xtuner", "xtuner": {}}}
        )


def test_global_batch_is_the_completions_of_a_step(tmp_path):
    spec = load_spec(_write(tmp_path, {"prompts_per_step": 2, "num_generations": 3}))
    assert spec.train.global_batch == 6  # filled in
    assert load_spec(_write(tmp_path, {"num_generations": 2}, global_batch=8)).train.global_batch == 8
    path = _write(tmp_path, {"num_generations": 2}, global_batch=16)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    text = "\n".join(err.value.errors)
    assert "train.global_batch: 16: a grpo step trains on its completions" in text and "4 x 2 = 8" in text, text
