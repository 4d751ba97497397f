"""The V-shaped zero-bubble schedule (parallel.schedule zbv; Qi et al. 2024 §6) as the planner prices it: its op order
is torch's ScheduleZBVZeroBubble's (planner/inflight.zbv_ops), a micro-batch's activations are held from its forward
to its weight pass, the head sits on rank 0 with the embedding, and the bubble is the attention core's share only.
Per-rank memory against the trainer: tests/distributed/test_pipeline_memory.py (pp4_zbv); parity: test_parity."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

from nightloom.catalog import MODELS
from nightloom.parallel import ParallelDims
from nightloom.perf import flops_per_token
from nightloom.planner import plan
from nightloom.planner.inflight import in_flight_layers, zbv_ops
from nightloom.planner.memory import rank_layers, rank_params


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_op_order_is_torchs(pp, m):
    """Every rank's ops equal torch 2.13's own schedule (F/I/W, local chunk, micro-batch; its padding dropped)."""
    torch_like = SimpleNamespace(pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m)
    for rank in range(pp):
        ours = zbv_ops(rank, pp, m)
        theirs = [a for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(torch_like, rank) if a is not None]
        local = {rank: 0, 2 * pp - 1 - rank: 1}
        assert ours == [(a.computation_type.value, local[a.stage_index], a.microbatch_index) for a in theirs], rank


def test_chunks_on_a_v_and_the_head_on_rank_0():
    c = ParallelDims(pp=4, virtual_stages=2, schedule="zbv", grad_accum=8, stages=(1, 2, 2, 2, 2, 2, 2, 3))
    assert [c.rank_chunks(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert c.rank_sizes(16) == (4, 4, 4, 4)
    shape = MODELS["llama3-8b"]
    params = rank_params(shape, ParallelDims(pp=4, virtual_stages=2, schedule="zbv", grad_accum=8))
    assert params[0] > params[1] == params[2] and params[3] == params[1]  # embedding and head both on rank 0
    # one layer a chunk, 8 micro-batches: rank r holds its chunks' forwards until their weight passes
    held = in_flight_layers((1,) * 8, 4, 8, "zbv")
    assert held == (8, 8, 8, 8)  # a V keeps every rank's count even (1F1B: 4, 3, 2, 1 of two layers each)
    assert in_flight_layers((2, 2, 2, 2), 4, 8, "1f1b") == (8, 6, 4, 2)
    assert rank_layers(shape, c) == c.rank_sizes(shape.layers)


def test_refused_where_it_cannot_run():
    tied = MODELS["llama3.2-1b"]
    assert tied.tied_embeddings  # tied runs (train/tied.LocalTiedCopies: both copies on rank 0)
    assert ParallelDims(pp=2, virtual_stages=2, schedule="zbv", grad_accum=4).check(tied, 2048, None) == []
    why = ParallelDims(pp=2, virtual_stages=4, schedule="zbv", grad_accum=4).check(MODELS["llama3-8b"], 2048, None)
    assert any("virtual_stages 2, got 4" in w for w in why), why


def test_llama3_405b_8k_zbv_fits_8192_h100_and_beats_interleaving():
    """Meta's degrees (TP8·PP16·FSDP64, no recompute) under zbv: two chunks a rank of 3 + 30·4 + 3 layers fit on
    8,192 H100 without offload and run faster than Meta's interleaved v=8 (bubble the attention core's share)."""
    kw = dict(nodes=1024, gpus_per_node=8, seq_len=8192, global_batch=2048)
    zbv = plan("llama3.1-405b", "h100-80gb", layout="tp=8,pp=16,dp=64,v=2,schedule=zbv,recompute=none", **kw).chosen
    v8 = plan(
        "llama3.1-405b", "h100-80gb", layout="tp=8,pp=16,dp=64,v=8,recompute=none,offload=0", stages="7:8*14:7", **kw
    ).chosen
    assert zbv.schedule == "zbv" and zbv.fits and zbv.offload_layers == 0, zbv.memory_gib_per_gpu
    assert not v8.fits and zbv.memory_gib_per_gpu < v8.memory_gib_per_gpu
    assert zbv.step_time_s < v8.step_time_s
    tflops = zbv.tokens_per_s * flops_per_token(MODELS["llama3.1-405b"], 8192) / 8192 / 1e12
    print(f"zbv {zbv.memory_gib_per_gpu:.1f} GiB, {tflops:.1f} TFLOP/s; v8 {v8.memory_gib_per_gpu:.1f} GiB")
    assert zbv.memory.activations_gib < v8.memory.activations_gib
    assert any("V-shaped zero-bubble" in x for x in zbv.explanation)
