"""train.task dpo priced by the planner (planner/post_training.py): a step's two rows a pair, every token's
logits, and the reference's no-grad forward (per step with the adapters off, once before training when
precomputed, or a frozen copy's weights), each equal to its formula against the planner's own pretraining
numbers for the same layout. The measured share of the reference pass on a tiny model against the planner's is
bench/rollout.py's (a measurement, not a test: torch's FLOP counter alone costs seconds to import)."""

from __future__ import annotations

import dataclasses

import pytest

from nightloom.catalog import MODELS, get_gpu
from nightloom.perf import count_params, flops_per_token
from nightloom.planner import PostTraining, plan, plan_for_spec
from nightloom.planner.memory import CE_CHUNK_TENSORS, CE_CHUNK_TOKENS, GIB, memory_breakdown
from nightloom.planner.steptime import DEFAULT_EFFICIENCY, step_time
from nightloom.spec import RunSpec

H100 = get_gpu("h100-80gb")
SEQ, PAIRS, STEPS = 4096, 64, 1000


def _spec(layout: dict, **train) -> RunSpec:
    cluster = {"nodes": 1, "gpus_per_node": 8, "gpu_type": "h100-80gb"}
    train = {"seq_len": SEQ, "global_batch": PAIRS, "steps": STEPS, **train}
    data = {"name": "p", "dataset": {"path": "d"}, "model": {"name": "llama3-8b"}, "cluster": cluster}
    return RunSpec.model_validate({**data, "train": train, "parallel": layout})


def _reference_s(rows_per_rank: int, tp: int = 1) -> float:
    """The reference's no-grad forward by hand: every token's forward FLOPs (a third of 6·N + attention + the
    head's 6·V·h) over tp ranks at the planner's efficiency of the bf16 peak (tp = 1: no all-reduces)."""
    fwd = flops_per_token(MODELS["llama3-8b"], SEQ, lm_head=True) / 3
    return rows_per_rank * SEQ * fwd / tp / (DEFAULT_EFFICIENCY * H100.peak("bf16"))


def test_a_step_is_both_rows_of_every_pair_plus_the_reference_forward():
    """LoRA with the adapters off on FSDP8: the step is the planner's pretraining step of 2·mb rows per
    micro-batch plus a no-grad forward of the rank's 16 rows (8 pairs); about 2.7x the sft step here."""
    layout = {"tp": 1, "dp_shard": -1, "micro_batch": 1}
    sft = plan_for_spec(_spec(layout, task="sft", lora={"rank": 16}), require_fit=False)
    dpo = plan_for_spec(_spec(layout, task="dpo", lora={"rank": 16}), require_fit=False)
    c = sft.chosen.dims()
    two_rows = step_time(MODELS["llama3-8b"], dataclasses.replace(c, micro_batch=2), SEQ, H100, 8, DEFAULT_EFFICIENCY)
    split = dpo.post_training
    assert split.reference == "adapters_off"
    assert split.training_s == pytest.approx(two_rows.step_s)
    assert split.reference_s == pytest.approx(_reference_s(2 * PAIRS // 8))
    assert dpo.chosen.step_time_s == pytest.approx(two_rows.step_s + split.reference_s)
    assert 2.5 < dpo.chosen.step_time_s / sft.chosen.step_time_s < 2.8
    # tokens/s counts both rows, as the trainer's step does
    assert dpo.chosen.tokens_per_s == pytest.approx(2 * PAIRS * SEQ / dpo.chosen.step_time_s)
    assert any("adapters off" in line for line in dpo.chosen.explanation)


def test_a_reference_free_loss_has_no_reference_pass():
    layout = {"tp": 1, "dp_shard": -1, "micro_batch": 1}
    simpo = plan_for_spec(_spec(layout, task="dpo", preference={"loss": "simpo"}), require_fit=False)
    assert simpo.post_training.reference == "none" and simpo.post_training.reference_s == 0
    assert simpo.chosen.step_time_s == pytest.approx(simpo.post_training.training_s)


def test_memory_is_two_rows_with_every_token_logits():
    """The trainer's DPO forward scores every completion token from the whole logits: where pretraining fuses the
    loss with the head in chunks (pp = tp = cp = 1), dpo holds the fp32 logits of both rows instead; under TP the
    logits were whole already. Model states are pretraining's."""
    shape = MODELS["llama3-8b"]
    for layout, chunked in (({"tp": 1, "dp_shard": -1, "micro_batch": 1}, True), ({"tp": 2, "dp_shard": -1}, False)):
        dpo = plan_for_spec(_spec(layout, task="dpo"), require_fit=False).chosen
        c = dpo.dims()
        rows = dataclasses.replace(c, micro_batch=2 * c.micro_batch)
        mem = memory_breakdown(shape, rows, SEQ)
        logits = 4 * 2 * c.micro_batch * SEQ * shape.vocab / c.tp
        chunks = 4 * CE_CHUNK_TENSORS * CE_CHUNK_TOKENS * shape.vocab if chunked else logits
        assert dpo.memory.activations_gib == pytest.approx(mem.activations_gib + (logits - chunks) / GIB)
        pre = memory_breakdown(shape, c, SEQ)
        assert (dpo.memory.weights_gib, dpo.memory.optimizer_gib) == pytest.approx((pre.weights_gib, pre.optimizer_gib))
        assert dpo.memory.activations_gib > 1.9 * pre.activations_gib


def test_a_precomputed_reference_is_one_pass_and_no_device_memory():
    """Full fine-tuning: the reference's pass before training scores the pairs the run reads (steps × global
    batch) once; the step time carries it spread over the steps (so the cost counts it), and training holds
    exactly what a reference-free loss holds. A frozen copy instead holds the policy's 16-bit weights again,
    sharded over the same 8 ranks."""
    layout = {"tp": 1, "dp_shard": -1, "micro_batch": 1}
    pre = plan_for_spec(_spec(layout, task="dpo", preference={"reference": "precomputed"}), require_fit=False)
    free = plan_for_spec(_spec(layout, task="dpo", preference={"loss": "simpo"}), require_fit=False)
    split = pre.post_training
    assert split.reference_s == pytest.approx(_reference_s(2 * PAIRS // 8))
    assert split.once_s == pytest.approx(STEPS * split.reference_s)
    assert pre.chosen.step_time_s == pytest.approx(free.chosen.step_time_s + split.once_s / STEPS)
    assert pre.chosen.memory_gib_per_gpu == pytest.approx(free.chosen.memory_gib_per_gpu)
    assert any("once" in line for line in pre.chosen.explanation)
    frozen = plan(
        "llama3-8b", "h100-80gb", 1, 8, SEQ, PAIRS, layout="tp=1,fsdp=8,mb=1,recompute=none",
        task=PostTraining("dpo", "frozen_copy", steps=STEPS),
    )  # fmt: skip
    copy = count_params(MODELS["llama3-8b"]) * 2 / 8 / GIB
    assert frozen.chosen.memory.weights_gib - free.chosen.memory.weights_gib == pytest.approx(copy, rel=1e-3)
    assert frozen.post_training.reference_gib == pytest.approx(copy, rel=1e-3)
    assert frozen.chosen.step_time_s == pytest.approx(pre.chosen.step_time_s)
