"""Planner memory under LoRA (train.lora): frozen base weights hold no gradients or optimizer state; the adapters,
r·(in + out) per targeted linear, carry weights, gradients and fp32 Adam state."""

from __future__ import annotations

import pytest

from nightloom.catalog import MODELS
from nightloom.parallel import ParallelDims
from nightloom.perf import count_params
from nightloom.planner import plan
from nightloom.planner.memory import GIB, lora_layer_params, memory_breakdown


def test_adapter_count_is_rank_times_in_plus_out():
    s = MODELS["llama3-8b"]  # h 4096, kv 8 × 128, ffn 14336
    assert lora_layer_params(s, 16, ("q_proj", "v_proj")) == 16 * (4096 + 4096) + 16 * (4096 + 1024)
    full = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert lora_layer_params(s, 16, ("all-linear",)) == full


def test_lora_states_are_the_adapters_only():
    s = MODELS["llama3-8b"]
    c = ParallelDims(dp_replicate=1, micro_batch=1, grad_accum=1)
    full = memory_breakdown(s, c, 4096)
    lora = memory_breakdown(s, c, 4096, lora_rank=16, lora_targets=("all-linear",))
    adapters = s.layers * lora_layer_params(s, 16, ("all-linear",))
    assert lora.weights_gib == pytest.approx((count_params(s) + adapters) * 2 / GIB)
    assert lora.grads_gib == pytest.approx(adapters * 2 / GIB)
    assert lora.optimizer_gib == pytest.approx(adapters * 12 / GIB)
    assert full.optimizer_gib > 80 and lora.optimizer_gib < 1
    assert lora.activations_gib == full.activations_gib


def test_lora_makes_an_8b_model_fit_one_gpu():
    assert not plan("llama3-8b", "h100-80gb", 1, 1, 4096, 8, layout="tp=1,pp=1,dp=1").feasible
    r = plan("llama3-8b", "h100-80gb", 1, 1, 4096, 8, layout="tp=1,pp=1,dp=1", lora_rank=16)
    assert r.feasible and r.chosen.memory.grads_gib < 0.2


def test_auto_layout_of_a_packed_sft_run_has_no_pipeline_or_context_parallel():
    """train.pack: the trainer refuses pp > 1 and cp > 1 (no per-row document mask there), so `parallel: auto`
    never picks them: Llama 3.1 405B at 32k tokens on 128 H100 with 8 sequences needs CP or PP unpacked and is an
    error packed, with 64 it plans neither packed; at 128k on 512 GPUs with a global batch of 16 nothing without CP
    fits the batch, which is an error before any rental."""
    from nightloom.planner import PlanError, plan_for_spec
    from nightloom.spec import RunSpec

    def spec(nodes: int, seq: int, batch: int, **train):
        cluster = {"nodes": nodes, "gpus_per_node": 8, "gpu_type": "h100-80gb"}
        model = {"name": "llama3.1-405b"}
        train = {"seq_len": seq, "global_batch": batch, **train}
        return RunSpec.model_validate(
            {"name": "p", "dataset": {"path": "d"}, "model": model, "cluster": cluster, "train": train}
        )

    unpacked = plan_for_spec(spec(16, 32768, 8), require_fit=False).chosen  # 8 sequences on 16 TP8 groups
    assert unpacked.cp > 1 or unpacked.pp > 1, unpacked.layout()
    with pytest.raises(PlanError, match="global batch 8 is not divisible by dp"):
        plan_for_spec(spec(16, 32768, 8, task="sft", pack=True), require_fit=False)
    packed = plan_for_spec(spec(16, 32768, 64, task="sft", pack=True), require_fit=False).chosen
    assert packed.pp == 1 and packed.cp == 1, packed.layout()
    assert plan_for_spec(spec(64, 131072, 16), require_fit=False).chosen.cp > 1
    with pytest.raises(PlanError, match="global batch 16 is not divisible by dp"):
        plan_for_spec(spec(64, 131072, 16, task="sft", pack=True), require_fit=False)
