"""The run spec: valid specs load; each kind of bad input is reported with file, line and field path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nightloom.spec import RunSpec, SpecError
from nightloom.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "deployments" / "local-demo.yaml"


def write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.fixture
def good(tmp_path) -> dict:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    return {"name": "t", "dataset": {"path": str(corpus)}, "sharding": {"num_shards": 4}}


def errors_of(path: Path) -> list[str]:
    with pytest.raises(SpecError) as ei:
        load_spec(path)
    return ei.value.errors


def test_demo_spec_loads():
    spec = load_spec(DEMO)
    assert isinstance(spec, RunSpec)
    assert spec.world_size == 4
    assert Path(spec.dataset.path).is_absolute()  # resolved against the spec's folder
    assert spec.spec_hash() == load_spec(DEMO).spec_hash()


def test_valid_minimal(tmp_path, good):
    spec = load_spec(write(tmp_path, good))
    assert spec.sharding.tolerance == 0.02 and spec.parallel == "auto"


@pytest.mark.parametrize(
    "patch, field, words",
    [
        ({"sharding": {"num_shards": 4, "tolernce": 0.1}}, "sharding.tolernce", "unknown key"),
        ({"train": {"steps": "many"}}, "train.steps", "integer"),
        ({"sharding": {"num_shards": -3}}, "sharding.num_shards", "greater than 0"),
        ({"sharding": {"num_shards": 4, "tolerance": 1.5}}, "sharding.tolerance", "less than 1"),
        ({"sharding": {"num_shards": 4, "tolerance": 0}}, "sharding.tolerance", "greater than 0"),
        ({"train": {"backend": "deepspeed"}}, "train.backend", "'native' or 'xtuner'"),
        ({"dataset": {"path": "/nonexistent/corpus.jsonl"}}, "dataset.path", "not found"),
        ({"schedule": {"timezone": "Mars/Olympus"}}, "schedule.timezone", "unknown time zone"),
        ({"parallel": {"tp": 3}}, "parallel", "world size"),
    ],
)
def test_bad_field_names_path_and_line(tmp_path, good, patch, field, words):
    data = {**good, **patch}
    path = write(tmp_path, data)
    errs = errors_of(path)
    assert any(f": {field}:" in e and words in e for e in errs), errs
    assert all(e.startswith(str(path)) for e in errs), errs
    if field != "dataset.path":  # semantic errors carry the file; schema errors also the line
        assert any(f"{path}:" in e and e.split(":")[1].strip().isdigit() for e in errs), errs


def test_several_errors_reported_together(tmp_path, good):
    data = {**good, "sharding": {"num_shards": 0, "tolerance": 2}, "train": {"backend": "x", "stepz": 1}}
    errs = errors_of(write(tmp_path, data))
    fields = {e.split(": ")[1] for e in errs}
    assert {"sharding.num_shards", "sharding.tolerance", "train.backend", "train.stepz"} <= fields, errs


def test_missing_file_and_broken_yaml(tmp_path):
    errs = errors_of(tmp_path / "nope.yaml")
    assert "file not found" in errs[0] and "nope.yaml" in errs[0]
    p = tmp_path / "broken.yaml"
    p.write_text("name: x\ndataset:\n  path: [unclosed\n")
    errs = errors_of(p)
    assert errs[0].startswith(f"{p}:") and "invalid YAML" in errs[0]
    assert errs[0].split(":")[1].isdigit()


@pytest.mark.slow
def test_cli_validate_exit_codes(tmp_path, good):
    ok = write(tmp_path, good)
    cli = [sys.executable, "-m", "flows.cli", "validate"]
    r = subprocess.run(cli + [str(ok)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**good, "sharding": {"num_shards": -1}}))
    r = subprocess.run(cli + [str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "sharding.num_shards" in r.stderr
    r = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2


def test_a_spec_written_before_new_fields_keeps_its_ledger_hash():
    """The ledger keys runs (and `golden.from_ledger`) by spec_hash: adding a field with a default must not change
    the hash of a spec that does not set it. The values were computed by the release before train.task,
    dataset.style and model.chat_template existed; a new field missing from HASH_NEUTRAL_DEFAULTS fails here."""
    from nightloom.spec import HASH_NEUTRAL_DEFAULTS

    plain = RunSpec.model_validate({"name": "pinned", "dataset": {"path": "/data/corpus.jsonl"}})
    xtuner = RunSpec.model_validate(
        {
            "name": "pinned",
            "dataset": {"path": "/data/corpus.jsonl"},
            "train": {"backend": "xtuner", "xtuner": {}, "global_batch": 8},
            "cluster": {"nodes": 2, "gpus_per_node": 2},
        }
    )
    assert (plain.spec_hash(), xtuner.spec_hash()) == ("4852eacf88b24184", "8f3b7f5eb77e33e8")
    # a field set away from its default does change the hash
    for (section, key), default in HASH_NEUTRAL_DEFAULTS.items():
        data = plain.model_dump(by_alias=True)
        if section == "parallel":  # plain's parallel is "auto": compare layouts with and without the field
            fixed = {**data, "parallel": {"tp": 1}}
            same = RunSpec.model_validate({**data, "parallel": {"tp": 1, key: default}}).spec_hash()
            assert same == RunSpec.model_validate(fixed).spec_hash(), key
            other = (not default) if isinstance(default, bool) else 2  # a switch flipped, or a degree of 2
            data, plain_hash = {**data, "parallel": {"tp": 1, key: other}}, RunSpec.model_validate(fixed).spec_hash()
            assert RunSpec.model_validate(data).spec_hash() != plain_hash, (section, key)
            continue
        if (section, key) == ("", "track"):  # a field of the spec itself: trackers on
            assert RunSpec.model_validate({**data, "track": ["tensorboard"]}).spec_hash() != plain.spec_hash()
            continue
        if section == "train.lora":  # a field of the nested lora section, on a LoRA run: neutral at its default
            lora = {"rank": 4}
            base = RunSpec.model_validate({**data, "train": {**data["train"], "lora": lora}}).spec_hash()
            same = {**data, "train": {**data["train"], "lora": {**lora, key: default}}}
            assert RunSpec.model_validate(same).spec_hash() == base, key
            value = {
                "quantize": "nf4",
                "double_quant": False,
                "compute_dtype": "bf16",
                "use_rslora": True,
                "use_dora": True,
                "merged_export": True,
                "modules_to_save": ["lm_head"],
                "trainable_token_indices": [3],
            }[key]
            changed = {**data, "train": {**data["train"], "lora": {**lora, key: value}}}
            assert RunSpec.model_validate(changed).spec_hash() != base, key
            continue
        if section == "train.grpo":  # a field of the nested grpo section, on a grpo run: neutral at its default
            grpo = {**data["train"], "task": "grpo", "grpo": {"num_generations": 2}}
            base = RunSpec.model_validate({**data, "train": grpo}).spec_hash()
            same = {**grpo, "grpo": {**grpo["grpo"], key: default}}
            assert RunSpec.model_validate({**data, "train": same}).spec_hash() == base, key
            value = {"engine": {"engine": "vllm"}, "vllm": {"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.5}}}
            changed = {**grpo, "grpo": {**grpo["grpo"], **value[key]}}  # vllm's section needs its engine
            changed_hash = RunSpec.model_validate({**data, "train": changed}).spec_hash()
            assert changed_hash != base, key
            if key == "vllm":  # the section itself counts, not only the engine it needs
                engine_only = {**grpo, "grpo": {**grpo["grpo"], "engine": "vllm"}}
                assert changed_hash != RunSpec.model_validate({**data, "train": engine_only}).spec_hash()
            continue
        if section == "validate.benchmarks":  # a field of the nested benchmarks section: neutral at its default
            bench = {**data["validate"], "benchmarks": {"tasks": ["hellaswag"]}}
            base = RunSpec.model_validate({**data, "validate": bench}).spec_hash()
            same = {**bench, "benchmarks": {**bench["benchmarks"], key: default}}
            assert RunSpec.model_validate({**data, "validate": same}).spec_hash() == base, key
            changed = {**bench, "benchmarks": {**bench["benchmarks"], key: {"auto": "hf"}[default]}}
            assert RunSpec.model_validate({**data, "validate": changed}).spec_hash() != base, key
            continue
        other = {"pretrain": "sft", "auto": "messages", None: "/t/chat.jinja", False: True}
        other |= {1024: 0, "tensorwise": "rowwise"}  # train.loss_chunk_tokens, train.fp8_recipe
        other |= {10: 3, 120: 60}  # recovery.max_preemptions, recovery.preempt_grace_s
        data[section][key] = "SIGUSR1" if (section, key) == ("recovery", "preempt_signal") else other[default]
        if (section, key) == ("train", "lora"):
            data["train"]["lora"] = {"rank": 4}
        if (section, key) == ("train", "pack"):  # packing needs train.task sft
            data["train"]["task"] = "sft"
        if (section, key) == ("train", "preference"):  # the preference section needs train.task dpo
            data["train"]["preference"], data["train"]["task"] = {"beta": 0.2}, "dpo"
        if (section, key) == ("train", "grpo"):  # the grpo section needs train.task grpo
            data["train"]["grpo"], data["train"]["task"] = {"num_generations": 2}, "grpo"  # 4 x 2 = global_batch
        if (section, key) == ("validate", "min_reward_accuracy"):
            data["validate"]["min_reward_accuracy"] = 0.7
        if (section, key) == ("validate", "min_reward_gain"):
            data["validate"]["min_reward_gain"] = 0.2
        if (section, key) == ("sharding", "near_dup"):
            data["sharding"]["near_dup"] = {}
        if (section, key) == ("sharding", "filters"):
            data["sharding"]["filters"] = {"c4": True}
        if (section, key) == ("validate", "benchmarks"):
            data["validate"]["benchmarks"] = {"tasks": ["hellaswag"]}
        assert RunSpec.model_validate(data).spec_hash() != plain.spec_hash(), (section, key)
