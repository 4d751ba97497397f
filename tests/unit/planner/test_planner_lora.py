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
