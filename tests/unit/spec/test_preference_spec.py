"""train.task dpo and train.preference: TRL's defaults, the reference resolved, and every layout or setting that
does not go with preference tuning refused at validate naming the field (FILE:LINE through load_spec)."""

from __future__ import annotations

import pytest
import yaml

from nightloom.spec import RunSpec, SpecError
from nightloom.spec.load import load_spec
from nightloom.spec.preference import PreferenceSpec


def _spec(tmp_path, train: dict, parallel="auto") -> RunSpec:
    corpus = tmp_path / "pairs.jsonl"
    corpus.write_text('{"prompt": "q", "chosen": " a", "rejected": " b"}\n')
    data = {"name": "p", "dataset": {"path": str(corpus)}, "train": {"task": "dpo", **train}, "parallel": parallel}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return RunSpec.model_validate(data), path


def test_defaults_are_trls_and_the_reference_follows_lora():
    p = PreferenceSpec()
    assert (p.loss, p.beta, p.label_smoothing, p.simpo_gamma, p.reference) == ("sigmoid", 0.1, 0.0, 0.5, "auto")
    assert p.reference_how(lora=True) == "adapters_off" and p.reference_how(lora=False) == "precomputed"
    assert PreferenceSpec(loss="simpo").reference_how(lora=False) == "none"
    assert PreferenceSpec(loss="ipo", reference="precomputed").reference_how(lora=True) == "precomputed"
    assert PreferenceSpec(reference="frozen_copy").reference_how(lora=False) == "frozen_copy"


@pytest.mark.parametrize(
    ("train", "parallel", "field", "words"),
    [
        ({}, {"pp": 2}, "", "parallel.pp: 2: train.task dpo runs in one process, on FSDP2"),
        ({}, {"cp": 2}, "", "parallel.cp: 2"),
        ({}, {"ep": 2}, "", "parallel.ep: 2"),
        ({"preference": {"reference": "adapters_off"}}, "auto", "", "adapters_off is the base without its adapters"),
        (
            {"lora": {"rank": 4}, "preference": {"reference": "frozen_copy"}},
            "auto",
            "",
            "frozen_copy is a second copy for full fine-tuning",
        ),
        ({"preference": {"loss": "ipo", "label_smoothing": 0.1}}, "auto", "train.preference", "sigmoid and simpo"),
        ({"preference": {"loss": "kto"}}, "auto", "train.preference.loss", "sigmoid"),
        ({"preference": {"beta": 0}}, "auto", "train.preference.beta", "greater than 0"),
        ({"pack": True}, "auto", "train.pack", "needs train.task: sft"),
    ],
)
def test_what_preference_tuning_refuses_is_named_at_validate(tmp_path, train, parallel, field, words):
    _, path = _spec(tmp_path, {}, "auto")
    data = yaml.safe_load(path.read_text())
    data["train"].update(train)
    data["parallel"] = parallel
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    text = "\n".join(err.value.errors)
    assert words in text and str(path) in text, text
    if field:
        assert f": {field}:" in text, text


def test_the_preference_section_needs_task_dpo(tmp_path):
    with pytest.raises(ValueError, match="train.preference: applies to train.task: dpo only"):
        RunSpec.model_validate({"name": "p", "dataset": {"path": "/d.jsonl"}, "train": {"preference": {}}})


def test_allowed_layouts_validate(tmp_path):
    for parallel in ("auto", {"dp_shard": 2}, {"tp": 2, "sp": True}, {"dp_shard": 2, "tp": 2}):
        spec, _ = _spec(tmp_path, {"lora": {"rank": 4}, "preference": {"loss": "ipo"}}, parallel)
        assert spec.train.task == "dpo" and spec.train.preference.loss == "ipo"


def test_a_spec_without_the_new_fields_keeps_its_hash_and_setting_them_changes_it():
    """The pinned hash of tests/unit/spec/test_spec.py's plain spec: train.preference and
    validate.min_reward_accuracy at their defaults are left out of it."""
    data = {"name": "pinned", "dataset": {"path": "/data/corpus.jsonl"}}
    assert RunSpec.model_validate(data).spec_hash() == "4852eacf88b24184"
    gated = RunSpec.model_validate({**data, "validate": {"min_reward_accuracy": 0.7}})
    dpo = RunSpec.model_validate({**data, "train": {"task": "dpo"}})
    tuned = RunSpec.model_validate({**data, "train": {"task": "dpo", "preference": {"beta": 0.2}}})
    assert len({gated.spec_hash(), dpo.spec_hash(), tuned.spec_hash(), "4852eacf88b24184"}) == 4
