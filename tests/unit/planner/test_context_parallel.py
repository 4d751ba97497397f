"""Context parallel in the step-time model: the K,V all-gather, how much of it the attention hides, per trainer."""

from __future__ import annotations

import pytest

from nightloom.catalog import MODELS, get_gpu
from nightloom.parallel import ParallelDims
from nightloom.planner.steptime import cp_exposed_s, step_time

BW, LAT = 50e9, 8e-6
BLOCK = 4 * 2**20  # one rank's K and V


def test_all_gather_trainer_exposes_every_collective():
    """Llama 3's CP (Grattafiori et al. 2024 §3.3.2): the forward gather and the backward reduce-scatter are on the
    critical path whatever the attention costs; a full recompute gathers once more."""
    gather = 15 * (BLOCK / BW + LAT)
    for fwd, bwd in ((0.0, 0.0), (1.0, 2.5)):
        assert cp_exposed_s(16, BLOCK, 2, BW, LAT, fwd, bwd, False, False) == pytest.approx(2 * gather)
        assert cp_exposed_s(16, BLOCK, 2, BW, LAT, fwd, bwd, True, False) == pytest.approx(3 * gather)


def test_torch_context_parallel_hides_the_gather_behind_the_diagonal_step():
    """torch's ALL_GATHER rotation: the gather overlaps the first (local) step, 1/cp of the attention; the fp32
    dK,dV hops overlap one step each. A long attention hides everything; none hides nothing."""
    gather = 15 * (BLOCK / BW + LAT)
    hop = 2 * BLOCK / BW + LAT
    bare = cp_exposed_s(16, BLOCK, 2, BW, LAT, 0.0, 0.0, False, True)
    assert bare == pytest.approx(2 * gather + 15 * hop)
    assert cp_exposed_s(16, BLOCK, 2, BW, LAT, 16.0, 40.0, False, True) == 0.0
    half = cp_exposed_s(16, BLOCK, 2, BW, LAT, 16 * gather / 2, 40.0, False, True)
    assert half == pytest.approx(gather / 2)


def test_grouped_kv_heads_cost_the_trainer_its_repeat():
    """nightloom's trainer repeats grouped K/V heads under CP (Transformer.expand_kv_heads), so it gathers heads/kv
    times the bytes an all-gather trainer sends grouped: for Llama 3.1 405B (128 / 8) the native CP term is larger."""
    shape = MODELS["llama3.1-405b"]
    gpu = get_gpu("h100-80gb")
    c = ParallelDims(tp=8, cp=16, dp_shard=128, sp=True, micro_batch=1, grad_accum=1, recompute="full")
    native, other = (step_time(shape, c, 131072, gpu, 8, 0.58, native_trainer=n) for n in (True, False))
    assert native.cp_comm_s > 4 * other.cp_comm_s > 0
    assert native.matmul_s == other.matmul_s
    no_cp = ParallelDims(tp=8, cp=1, dp_shard=2048, sp=True, micro_batch=1, grad_accum=1, recompute="full")
    assert step_time(shape, no_cp, 8192, gpu, 8, 0.58).cp_comm_s == 0.0


def test_saved_kv_follow_the_trainer():
    """Saved K/V per local token under CP: nightloom's trainer keeps them repeated (q_dim), an all-gather trainer
    the gathered grouped ones (cp · kv_dim): for Llama 3 8B (32 heads, 8 KV) at cp=2 half the bytes."""
    from nightloom.planner.activations import activation_bytes_per_layer

    shape = MODELS["llama3-8b"]
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    seq, t = 4096, 2
    native, other = (
        activation_bytes_per_layer(shape, seq, 1, t, False, "none", cp=2, other_trainer=o) for o in (False, True)
    )
    assert native - other == pytest.approx(seq * 2 * 2 * (q_dim - 2 * kv_dim) / t)
