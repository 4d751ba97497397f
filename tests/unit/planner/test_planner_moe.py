"""Planner for mixture-of-experts models: expert parallel's rules, experts' memory over EP, the all-to-all's time
and links, and the search picking EP for Mixtral 8x7B."""

from __future__ import annotations

import pytest

from nightloom.catalog import MODELS, get_gpu
from nightloom.parallel import ParallelDims
from nightloom.perf import expert_params
from nightloom.planner import plan
from nightloom.planner.memory import GIB, memory_breakdown
from nightloom.planner.steptime import all_to_all_s, step_time

MIX = MODELS["mixtral-8x7b"]
H100 = get_gpu("h100-80gb")


def test_ep_rules_name_what_is_wrong():
    ok = ParallelDims(dp_shard=8, ep=4, zero="fsdp")
    assert ok.check(MIX, 4096, None) == [] and ok.expert_shard == 2
    assert "is dense" in ParallelDims(dp_shard=8, ep=2).check(MODELS["llama3-8b"], 4096, None)[0]
    assert "does not divide the 8 experts" in " ".join(ParallelDims(dp_shard=16, ep=16).check(MIX, 4096, None))
    why = " ".join(ParallelDims(dp_replicate=2, dp_shard=4, ep=8).check(MIX, 4096, None))
    assert "dp_shard·cp = 4" in why  # EP is drawn from the sharded ranks under FSDP
    # replicas: EP drawn from dp_replicate is a layout other trainers run (a what-if); nightloom's draws from dp_shard
    assert ParallelDims(dp_replicate=8, ep=8).check(MIX, 4096, None, native_trainer=False) == []
    assert "EP is drawn from dp_shard only" in " ".join(ParallelDims(dp_replicate=8, ep=8).check(MIX, 4096, None))
    # nor TP, PP or CP for MoE layers in nightloom's trainer: the planner, the spec and the trainer share the rule
    assert "no tensor parallel" in " ".join(ParallelDims(tp=2, dp_shard=4).check(MIX, 4096, None))
    assert ParallelDims(tp=2, dp_shard=4).check(MIX, 4096, None, native_trainer=False) == []


def test_experts_states_divide_by_ep_dense_parts_do_not():
    """Replicated DP with EP: each rank holds experts / ep with their grads and Adam state; the rest is whole."""
    one, eight = (
        memory_breakdown(MIX, ParallelDims(dp_replicate=8, ep=ep, micro_batch=1, grad_accum=8), 4096) for ep in (1, 8)
    )
    saved = expert_params(MIX) * (1 - 1 / 8) * 16 / GIB  # bf16 weight + grad + fp32 master, m, v
    total_one = one.weights_gib + one.grads_gib + one.optimizer_gib
    total_eight = eight.weights_gib + eight.grads_gib + eight.optimizer_gib
    assert total_one - total_eight == pytest.approx(saved, rel=1e-9)
    # under FSDP over the same ranks, EP moves the experts' sharding, not its total
    f1, f8 = (memory_breakdown(MIX, ParallelDims(dp_shard=8, ep=ep, grad_accum=8), 4096) for ep in (1, 8))
    assert f1.optimizer_gib == pytest.approx(f8.optimizer_gib, rel=1e-9)


def test_all_to_all_is_slower_across_nodes():
    c_in = ParallelDims(dp_shard=8, ep=8)
    c_out = ParallelDims(tp=4, dp_shard=4, ep=4)  # ep ranks strided by tp=4: 2 per 8-GPU node
    assert all_to_all_s(ParallelDims(dp_shard=8), 1e9, 8, H100) == 0.0
    inside, across = all_to_all_s(c_in, 1e9, 8, H100), all_to_all_s(c_out, 1e9, 8, H100)
    assert inside == pytest.approx(7 / 8 * 1e9 / H100.intra_node_bw + H100.intra_node_latency_s)
    assert across == pytest.approx(2 / 4 * 1e9 / H100.inter_node_bw + H100.inter_node_latency_s)
    st = step_time(MIX, ParallelDims(dp_shard=8, ep=8, grad_accum=4), 4096, H100, 8, 0.58)
    assert (
        st.ep_comm_s > 0 and step_time(MIX, ParallelDims(dp_shard=8, grad_accum=4), 4096, H100, 8, 0.58).ep_comm_s == 0
    )


def test_mixtral_plan_fits_with_what_the_trainer_runs_and_prices_expert_parallel():
    """On 16 × H100 (8 cannot hold 46.7B × 16 B of mixed-precision Adam state: 93 GB each before activations) the
    search keeps to the trainer's MoE layouts (FSDP2 and EP, no TP/PP/CP) and weighs EP against plain FSDP2."""
    assert not plan("mixtral-8x7b", "h100-80gb", 1, 8, 4096, 64).feasible
    r = plan("mixtral-8x7b", "h100-80gb", 2, 8, 4096, 64)
    assert r.chosen.fits and (r.chosen.tp, r.chosen.pp, r.chosen.cp) == (1, 1, 1), r.chosen.layout()
    assert r.chosen.ep > 1 or "·EP" in " ".join(r.chosen.explanation)  # EP weighed: chosen, or the next best
    c = plan("mixtral-8x7b", "h100-80gb", 2, 8, 4096, 64, layout="dp=16,ep=4").chosen
    assert c.fits and c.ep == 4, (c.layout(), c.explanation)
    text = " ".join(c.explanation)
    assert f"expert parallel ep={c.ep}" in text and "12.88B active" in text
    assert c.layout().endswith(f"EP{c.ep}")
    # MFU counts activated parameters: far below what 46.7B total would claim
    assert 0.1 < c.mfu < 0.6


def test_pinned_ep_is_evaluated():
    r = plan("qwen3-30b-a3b", "h100-80gb", 1, 8, 4096, 64, layout="tp=1,pp=1,dp=8,ep=8")
    assert r.chosen.ep == 8 and r.evaluated and "each rank computes 16 of 128 experts" in " ".join(r.chosen.explanation)


def test_auto_layout_of_an_moe_run_is_what_the_trainer_runs():
    """`parallel: auto` for a mixture of experts picks only what train/moe.py trains: EP and FSDP2, no TP, PP,
    CP or replicas (the planner's what-ifs through `nightloom plan --layout` still price the others)."""
    from nightloom.planner import plan_for_spec
    from nightloom.spec import RunSpec

    for model, nodes in (("mixtral-8x7b", 2), ("qwen3-30b-a3b", 1), ("qwen3-235b-a22b", 8)):
        spec = RunSpec.model_validate(
            {
                "name": "m",
                "dataset": {"path": "d"},
                "model": {"name": model},
                "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu_type": "h100-80gb"},
                "train": {"seq_len": 4096, "global_batch": 64},
            }
        )
        c = plan_for_spec(spec, require_fit=False).chosen
        assert (c.tp, c.pp, c.cp, c.dp_replicate) == (1, 1, 1, 1), (model, c.layout())
