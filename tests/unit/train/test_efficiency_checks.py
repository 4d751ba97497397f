"""train.precision fp8 and train.compile refuse what they do not run, naming the field, before anything is built;
the catalog's FP8 peaks (H100/H200) and the planner's MFU against both peaks, labelled."""

from __future__ import annotations

import pytest

from nightloom.parallel import ParallelPlan
from nightloom.planner import plan_for_spec
from nightloom.spec import RunSpec
from nightloom.train.parallelize import check_compile, check_fp8


def test_fp8_is_refused_on_cpu_naming_the_field():
    with pytest.raises(ValueError, match=r"train\.precision: fp8 needs a CUDA GPU.*runs on cpu"):
        check_fp8(ParallelPlan(), "cpu", lora=False)


def test_fp8_is_refused_with_tp_or_lora():
    with pytest.raises(ValueError, match=r"train\.precision: fp8 .*TP2"):
        check_fp8(ParallelPlan(tp=2), "cuda", lora=False)
    with pytest.raises(ValueError, match=r"train\.lora set"):
        check_fp8(ParallelPlan(), "cuda", lora=True)
    check_fp8(ParallelPlan(dp_shard=8), "cuda", lora=False)  # FSDP2: runs


def test_compile_is_refused_under_tp_with_recompute():
    """Compile runs under TP (and SP, PP, FSDP2) but not a recomputed block under TP (torch 2.13): refused by the
    trainer naming both fields, by the spec before anything is rented, and never planned by `parallel: auto`."""
    for rc in ("full", "selective"):
        with pytest.raises(
            ValueError, match=rf"train\.compile: true with parallel\.tp 2 and parallel\.recompute '{rc}'"
        ):
            check_compile(ParallelPlan(tp=2, sp=True, recompute=rc))
    check_compile(ParallelPlan(tp=2, sp=True))
    check_compile(ParallelPlan(dp_shard=2, recompute="full"))
    base = {"name": "c", "dataset": {"path": "d"}, "model": {"name": "llama3-8b"}}
    cluster = {"nodes": 1, "gpus_per_node": 8, "gpu_type": "h100-80gb"}
    train = {"seq_len": 4096, "global_batch": 8, "compile": True}
    with pytest.raises(ValueError, match=r"train\.compile: true with parallel\.tp 2 and parallel\.recompute 'full'"):
        RunSpec.model_validate(base | {"cluster": cluster, "train": train, "parallel": {"tp": 2, "recompute": "full"}})
    auto = RunSpec.model_validate(base | {"cluster": cluster, "train": train})
    assert plan_for_spec(auto, require_fit=False).chosen.recompute == "none"


def test_planner_reports_fp8_mfu_against_both_peaks():
    from nightloom.catalog import GPUS
    from nightloom.planner import plan

    assert GPUS["h100-80gb"].peak("fp8") == GPUS["h200"].peak("fp8") == 1979e12
    with pytest.raises(ValueError, match="a100-80gb: no FP8"):
        GPUS["a100-80gb"].peak("fp8")
    r = plan("llama3-8b", "h100-80gb", 1, 8, 8192, 64, precision="fp8")
    line = next(x for x in r.chosen.explanation if x.startswith("MFU"))
    fp8, bf16 = r.chosen.mfu, r.chosen.mfu * 1979 / 989
    assert f"{fp8:.1%} of the FP8 peak (1979 TFLOP/s)" in line and f"{bf16:.1%} of the bf16 peak (989" in line
