"""parallel.reduce_each_micro_batch as the planner prices it (planner/grad_sync.py, memory.py, steptime.py) and
sequence parallel's second gather in backward (train/sp_shard.py) in the step time: memory without FSDP2's
accumulated fp32 gradients, time with a reduce-scatter per micro-batch, chosen by the search only where the
default does not fit. What FSDP2 itself holds either way: test_fsdp_accumulated_grads.py and, under PP,
tests/distributed/test_pipeline_memory.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nightloom.catalog import MODELS, get_gpu
from nightloom.parallel import ParallelDims
from nightloom.planner import plan
from nightloom.planner.memory import ACCUM_GRAD_BYTES, GIB, memory_breakdown, rank_params
from nightloom.planner.steptime import step_time

SHAPE = MODELS["llama2-70b"]
GPU = get_gpu("h100-80gb")


@pytest.mark.parametrize("pp", [1, 2])
def test_memory_drops_the_accumulated_gradients_and_time_adds_the_reduce_scatters(pp):
    c = ParallelDims(tp=8, pp=pp, dp_shard=16 // pp, sp=True, micro_batch=1, grad_accum=8, recompute="full")
    each = replace(c, reduce_each_micro_batch=True)
    held, freed = (memory_breakdown(SHAPE, x, 4096) for x in (c, each))
    stage = max(rank_params(SHAPE, c))
    assert (held.grads_gib - freed.grads_gib) * GIB == pytest.approx(stage * ACCUM_GRAD_BYTES, rel=1e-6)
    assert held.activations_gib == freed.activations_gib
    t_last, t_each = (step_time(SHAPE, x, 4096, GPU, 8, 0.5) for x in (c, each))
    if pp == 1:  # gradient accumulation: 7 reduce-scatters more, each hidden only up to the micro-batch's compute
        assert t_each.dp_exposed_s >= t_last.dp_exposed_s
    else:  # torch's schedule reduces the stage once after the last backward, exposed; each one overlaps its own
        assert t_each.dp_exposed_s <= t_last.dp_exposed_s
    one = replace(c, grad_accum=1)  # one micro-batch: the same thing either way
    assert memory_breakdown(SHAPE, one, 4096) == memory_breakdown(
        SHAPE, replace(one, reduce_each_micro_batch=True), 4096
    )


def test_sequence_parallel_gathers_again_in_backward():
    """Two all-gathers more per layer (the attention's and the MLP's inputs) under SP, none under full recompute
    (the block recomputes its gathers anyway) nor for other trainers (Megatron overlaps them)."""
    c = ParallelDims(tp=8, dp_shard=8, sp=True, micro_batch=1, grad_accum=4)
    native, other = (step_time(SHAPE, c, 4096, GPU, 8, 0.5, native_trainer=n) for n in (True, False))
    no_sp = replace(c, sp=False)
    assert native.tp_comm_s > other.tp_comm_s
    # an all-gather moves half of an all-reduce's bytes: 4 all-reduces + 2 gathers = 5 all-reduces' worth
    assert native.tp_comm_s / step_time(SHAPE, no_sp, 4096, GPU, 8, 0.5).tp_comm_s == pytest.approx(5 / 4, rel=0.01)
    full = replace(c, recompute="full")
    assert (
        step_time(SHAPE, full, 4096, GPU, 8, 0.5).tp_comm_s
        == step_time(SHAPE, full, 4096, GPU, 8, 0.5, native_trainer=False).tp_comm_s
    )


def test_the_search_reduces_each_micro_batch_only_where_that_fits():
    kw = dict(model="llama2-70b", gpu="h100-80gb", nodes=4, gpus_per_node=8, seq_len=4096, global_batch=64)
    tight = plan(**kw, layout="tp=4,pp=2,dp=4,zero=fsdp,recompute=full").chosen  # 52.3 GiB
    assert tight.reduce_each_micro_batch and tight.fits
    pinned = plan(**kw, layout="tp=4,pp=2,dp=4,zero=fsdp,recompute=full,reduce_each=0").chosen  # 83.9 GiB
    assert not pinned.reduce_each_micro_batch and not pinned.fits
    roomy = plan(**(kw | {"model": "llama3-8b"}), layout="tp=1,pp=1,dp=32,zero=fsdp,mb=1").chosen
    assert roomy.fits and not roomy.reduce_each_micro_batch  # fits without: not taken
