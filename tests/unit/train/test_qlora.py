"""train.lora.quantize in the spec (refusals by name, hash kept for specs written before) and QLoRA's memory in the
planner (a 4-bit base and one layer's dequantized copy) against the published figures."""

from __future__ import annotations

import pytest

from nightloom.spec import RunSpec


def parse_spec(data: dict) -> RunSpec:
    return RunSpec.model_validate(data)


BASE = {"name": "x", "dataset": {"path": "d.jsonl"}, "train": {"lora": {"rank": 8}}}


def test_spec_refuses_tp_and_pp_over_a_quantized_base():
    for par in ({"tp": 2}, {"pp": 2}):
        spec = {
            **BASE,
            "parallel": par,
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "train": {"lora": {"quantize": "nf4"}},
        }
        with pytest.raises(Exception, match=r"train.lora.quantize: a nf4 base .* must be 1"):
            parse_spec(spec)
    with pytest.raises(Exception, match=r"train.lora.quantize"):
        parse_spec({**BASE, "train": {"lora": {"quantize": "nf3"}}})
    ok = parse_spec(
        {
            **BASE,
            "parallel": {"dp_shard": 2},
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "train": {"lora": {"quantize": "nf4"}},
        }
    )
    assert ok.train.lora.quantize == "nf4" and ok.train.lora.double_quant


def test_a_lora_spec_written_before_keeps_its_hash_and_quantize_changes_it():
    plain = parse_spec(BASE)
    data = plain.model_dump(mode="json", by_alias=True)
    for key in ("quantize", "double_quant", "compute_dtype", "use_rslora"):  # a spec written before the fields
        data["train"]["lora"].pop(key)
    assert "quantize" not in str(data["train"]["lora"])
    assert parse_spec({**BASE, "train": {"lora": {"rank": 8, "double_quant": True}}}).spec_hash() == plain.spec_hash()
    quant = parse_spec({**BASE, "train": {"lora": {"rank": 8, "quantize": "nf4"}}})
    assert quant.spec_hash() != plain.spec_hash()


def test_the_summary_names_the_checkpoints_size():
    from nightloom.report import RunSummary
    from nightloom.train.job import TrainResult

    s = RunSummary(run_id="r1", name="qlora", status="completed", run_dir="/runs/r1")
    done = dict(steps_done=3, total_steps=3, stopped="completed", final_loss=1.0, tokens=1, wall_s=1.0)
    s.add_outputs(TrainResult(**done, adapter_dir="/runs/r1/export/adapter", checkpoint_bytes=3 * 2**20 + 2**19))
    assert s.output_rows() == [("adapter", "/runs/r1/export/adapter"), ("checkpoint", "3.5 MiB")]
    s.add_outputs(TrainResult(**done))
    assert s.output_rows() == []


def test_validate_names_the_linears_bitsandbytes_cannot_quantize(tmp_path):
    from nightloom.spec.checks import semantic_errors

    data = {**BASE, "model": {"name": "tiny"}, "train": {"lora": {"quantize": "nf4"}}}  # MLP width 176
    errs = [why for field, why in semantic_errors(data, tmp_path) if field == ("train", "lora", "quantize")]
    assert errs == [
        "tiny: a quantized linear needs in a multiple of 64 and out of 32; up_proj 64 -> 176, down_proj 176 -> 64"
    ]
    data["model"] = {"name": "small"}  # 256 wide, MLP 704
    assert not [f for f, _ in semantic_errors(data, tmp_path) if f == ("train", "lora", "quantize")]
