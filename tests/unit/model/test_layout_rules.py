"""One owner for the layout rules: ParallelDims fills -1 and checks; the planner never emits what the trainer
refuses; plain data parallel has one spelling; uneven stages, ZeRO-2 and context parallel in the search."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from nightloom.catalog import MODELS, get_model
from nightloom.parallel import LAYOUT_FIELDS, LayoutError, ParallelDims, ParallelPlan
from nightloom.planner import PlanError, parse_layout, plan
from nightloom.planner.memory import memory_breakdown
from nightloom.planner.stage_splits import stage_splits
from nightloom.planner.steptime import step_time
from nightloom.train.parallelize import validate_plan


def _trainer_accepts(shape, p: ParallelPlan, seq: int, gb: int, device: str) -> None:
    validate_plan(shape, p, seq, gb, p.world_size, device)  # raises LayoutError naming the rule


GRID = [f"tp={tp},pp={pp}" for tp, pp in itertools.product((1, 2, 4, 8), (1, 2, 3, 4)) if tp * pp <= 16]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_planner_accepted_implies_trainer_accepted(name):
    """Every catalog model over a grid of pinned layouts, on GPUs and on CPU ranks, and the free search: each
    plan the planner returns (chosen and alternatives) passes the trainer's validate_plan."""
    shape = MODELS[name]
    seq = min(512, shape.max_seq)
    accepted = 0
    for gpu, device in (("h100-80gb", "cuda"), ("cpu", "cpu")):
        for layout in [None, *GRID]:
            try:
                r = plan(shape, gpu, 2, 8, seq, 32, layout=layout)
            except PlanError:  # this layout does not fit or divide: nothing to compare
                continue
            for p in [r.chosen, *r.alternatives]:
                _trainer_accepts(shape, p, seq, 32, device)
                accepted += 1
    assert accepted > 0


def test_tied_embeddings_run_under_tp_and_pp():
    """The trainer ties embeddings under every layout (one vocab-sharded matrix under TP, the first and last stage's
    copies summed under PP): no layout rule refuses a tied model, and the planner proposes TP and PP for one."""
    tied = get_model("tiny-tied")
    for dims in (ParallelDims(tp=2), ParallelDims(pp=2, grad_accum=2), ParallelDims(tp=2, pp=2, grad_accum=2)):
        assert dims.check(tied, 128, None, device_type="cpu") == [], dims
        _trainer_accepts(tied, ParallelPlan.of(dims), 128, None, "cpu")
    for layout in ("tp=2", "pp=2", "tp=2,pp=2"):
        c = plan(tied, "a100-80gb", 1, 4, 128, 8, layout=layout).chosen
        assert (c.tp, c.pp) == (2 if "tp" in layout else 1, 2 if "pp" in layout else 1)
        assert not any("not applied" in x for x in c.explanation)  # nightloom's own rules, not a what-if
    # a tied model too big for one GPU's share: the free search splits it with TP and PP, and the trainer takes it
    # (with PTD-P's materialised scores, as it ran: with a fused kernel FSDP over 64 GPUs alone fits, and so it does
    # with activation offload, which is pinned off here)
    c = plan("gpt-39.1b", "a100-80gb", 8, 8, 2048, 512, fused_attention=False, layout="offload=0").chosen
    assert c.tp * c.pp > 1 and c.fits, c.layout()
    _trainer_accepts(MODELS["gpt-39.1b"], c, 2048, 512, "cuda")


def test_resolve_fills_minus_one_and_names_the_values():
    d = ParallelDims.resolve(32, tp=4, pp=2)
    assert (d.dp_shard, d.world_size, d.zero) == (4, 32, "fsdp")
    assert ParallelDims.resolve(8, tp=8).zero == "none"  # dp_shard 1: nothing to shard
    with pytest.raises(LayoutError, match=r"world size 8 is not divisible by tp\(1\)·pp\(3\)"):
        ParallelDims.resolve(8, pp=3)
    with pytest.raises(LayoutError, match=r"= 16 != world size 8"):
        ParallelDims.resolve(8, tp=2, dp_shard=8)


def test_plain_data_parallel_is_only_dp_replicate():
    with pytest.raises(LayoutError, match="spell it dp_replicate=4"):
        ParallelDims(dp_shard=4, zero="none")
    with pytest.raises(ValueError, match="plain data parallel is dp_replicate=4"):
        parse_layout("dp_shard=4,zero=none")
    # an old plan (job.json, ledger row) in the old spelling reads as replicas on the same ranks, with a note
    old = ParallelPlan.model_validate({"tp": 2, "dp_shard": 4, "zero": "none", "micro_batch": 2})
    assert (old.dp_replicate, old.dp_shard, old.zero, old.layout()) == (4, 1, "none", "TP2·PP1·DP4")
    assert "old spelling" in old.explanation[-1]
    new = ParallelDims(tp=2, dp_replicate=4)
    assert [new.dp_rank(r) for r in range(8)] == [
        ParallelDims(tp=2, dp_shard=4).dp_rank(r) for r in range(8)
    ]  # same rank arithmetic
    # the planner's replicas are on dp_replicate
    c = plan("llama2-7b", "h100-80gb", 1, 8, 4096, 64, layout="tp=2,pp=1,dp=4,zero=none").chosen
    assert (c.dp_replicate, c.dp_shard, c.zero) == (4, 1, "none")


def test_spec_rejects_zero_none_and_checks_the_layout(tmp_path):
    from nightloom.spec import SpecError
    from nightloom.spec.load import parse_spec

    base = {
        "name": "t",
        "dataset": {"path": "x", "sample": True},
        "cluster": {"nodes": 1, "gpus_per_node": 4},
        "train": {"seq_len": 64, "global_batch": 8},
    }
    with pytest.raises(SpecError, match="plain data parallel is dp_replicate"):
        parse_spec({**base, "parallel": {"dp_shard": 4, "zero": "none"}})
    assert parse_spec({**base, "model": {"name": "tiny-tied"}, "parallel": {"tp": 2}}).parallel.tp == 2  # tied runs
    with pytest.raises(SpecError, match=r"parallel: kv_heads \(2\) must be divisible by tp \(4\): tp=4 does not ") as e:
        parse_spec({**base, "parallel": {"tp": 4}})
    assert "heads (4)" not in str(e.value)  # tp=4 divides heads (4): only kv_heads is named
    ok = parse_spec({**base, "parallel": {"pp": 2, "stages": [3, 1], "micro_batch": 1}})
    assert ok.parallel.stages == [3, 1]


def test_stage_splits_balance_the_ends():
    assert stage_splits(126, 16)[0] == (7,) + (8,) * 14 + (7,)  # Llama 3 405B on 16 stages
    assert stage_splits(80, 32) == ()  # nothing with equal inner stages: the family is rejected
    assert stage_splits(4, 3, pinned=True) == ((1, 2, 1),)
    assert None in stage_splits(32, 4)


def test_405b_meta_layout_evaluates_with_uneven_stages():
    """TP8·PP16·DP128 for Llama 3 405B (126 layers) on 16,384 H100 at seq 8,192: evaluated, not refused."""
    r = plan("llama3-405b", "h100-80gb", 2048, 8, 8192, 2048, layout="tp=8,pp=16,dp=128")
    c = r.chosen
    assert (c.tp, c.pp, c.dp_replicate * c.dp_shard) == (8, 16, 128) and c.fits
    assert sum(c.stages) == 126 and c.stages[0] < max(c.stages)
    assert any(x.startswith("pipeline: ") and "busiest" in x and "slowest" in x for x in c.explanation)
    forced = plan(
        "llama3-405b", "h100-80gb", 2048, 8, 8192, 2048, layout="tp=8,dp=128", stages="7" + ",8" * 14 + ",7"
    ).chosen
    # a forced list of pp sizes is layers per pipeline rank: the search may interleave each rank's layers into v
    # chunks (Llama 3 §3.3.2); whatever v it picks, every rank holds the layers the list gives it
    published = [7] + [8] * 14 + [7]
    v = forced.virtual_stages
    assert forced.pp == 16 and len(forced.stages) == 16 * v
    assert [sum(forced.stages[r::16]) for r in range(16)] == published, (v, forced.stages)


def test_uneven_stage_memory_and_time_are_the_busiest_and_slowest():
    s = MODELS["llama2-7b"]
    even = ParallelDims(tp=1, pp=2, dp_replicate=1, micro_batch=1, grad_accum=8)
    heavy = ParallelDims(tp=1, pp=2, dp_replicate=1, micro_batch=1, grad_accum=8, stages=(24, 8))
    gpu = __import__("nightloom.catalog", fromlist=["get_gpu"]).get_gpu("h100-80gb")
    assert memory_breakdown(s, heavy, 4096).total_gib > memory_breakdown(s, even, 4096).total_gib
    t_even, t_heavy = (step_time(s, c, 4096, gpu, 8, 0.5) for c in (even, heavy))
    assert t_heavy.slot_max_s > t_even.slot_max_s and t_heavy.step_s > t_even.step_s


def test_zero2_sits_between_replicas_and_fsdp():
    s = MODELS["llama2-7b"]
    kw = dict(tp=1, pp=1, micro_batch=1, grad_accum=8, recompute="full")
    rep = memory_breakdown(s, ParallelDims(dp_replicate=8, **kw), 4096)
    z2 = memory_breakdown(s, ParallelDims(dp_shard=8, zero="zero2", **kw), 4096)
    z3 = memory_breakdown(s, ParallelDims(dp_shard=8, zero="fsdp", **kw), 4096)
    assert z3.total_gib < z2.total_gib < rep.total_gib
    gpu = __import__("nightloom.catalog", fromlist=["get_gpu"]).get_gpu("h100-80gb")
    t2 = step_time(s, ParallelDims(dp_shard=8, zero="zero2", **kw), 4096, gpu, 8, 0.5)
    t3 = step_time(s, ParallelDims(dp_shard=8, zero="fsdp", **kw), 4096, gpu, 8, 0.5)
    assert t2.step_s <= t3.step_s  # one all-gather per micro-batch instead of two
    r = plan("llama2-7b", "h100-80gb", 1, 8, 4096, 64, layout="tp=1,pp=1,dp=8,zero=zero2")
    assert r.chosen.zero == "zero2" and "ZeRO2-8" in r.chosen.layout()
    assert any("ZeRO-2" in x for x in r.chosen.explanation)


def test_long_context_searches_context_parallel():
    # Llama 3.1 has Llama 3's shapes with a 128k context
    l8 = dataclasses.replace(MODELS["llama3-8b"], name="llama3.1-8b", max_seq=131072)
    l70 = dataclasses.replace(MODELS["llama3-70b"], name="llama3.1-70b", max_seq=131072)
    r = plan(l8, "h100-80gb", 4, 8, 131072, 8)
    assert r.chosen.cp > 1 and r.chosen.fits, r.chosen.explanation
    assert any(x.startswith("context parallel cp=") for x in r.chosen.explanation)
    pinned = plan(l70, "h100-80gb", 16, 8, 32768, 16, layout="tp=8,cp=4,pp=1")
    assert pinned.chosen.cp == 4
    # the native trainer runs CP on CUDA only, and not with PP: the planner says so before anything runs
    with pytest.raises(PlanError, match=r"context parallel \(cp=4\) with pp \(2\) > 1 is not supported"):
        plan(l70, "h100-80gb", 16, 8, 32768, 16, layout="tp=8,cp=4,pp=2")
    with pytest.raises(LayoutError, match="runs on CUDA only"):
        validate_plan(MODELS["llama3-8b"], ParallelPlan(cp=2, micro_batch=8), 8192, 8, 2, "cpu")


def test_plan_table_has_one_owner_and_keeps_rejection_reasons():
    r = plan("llama2-70b", "a800-80gb", 8, 4, 4096, 32)
    rows = r.table_rows(rejected=5)
    assert all(list(row) == list(rows[0]) for row in rows) and "" not in rows[0]
    assert rows[0]["status"] == "chosen"
    rej = [row for row in rows if row["status"] == "rejected"]
    assert len(rej) == 5 and all(row["reason"] for row in rej)


def test_spec_stages_reach_the_plan():
    from nightloom.planner import plan_for_spec
    from nightloom.spec.load import parse_spec

    spec = parse_spec(
        {
            "name": "t",
            "dataset": {"path": "x", "sample": True},
            "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "h100-80gb"},
            "model": {"name": "llama2-7b"},
            "train": {"seq_len": 4096, "global_batch": 16},
            "parallel": {"tp": 8, "pp": 2, "stages": [17, 15], "recompute": "full"},
        }
    )
    c = plan_for_spec(spec).chosen
    assert (c.tp, c.pp, c.stages, c.grad_accum) == (8, 2, [17, 15], 16)
    assert any("17:15" in x for x in c.explanation)
    assert c.dims().check(MODELS["llama2-7b"], 4096, 16, device_type="cuda") == []


def test_cli_stages_cp_and_json(capsys):
    import argparse
    import json

    from flows.commands import plan as plan_cmd

    parser = argparse.ArgumentParser(prog="nightloom")
    plan_cmd.register(parser.add_subparsers(dest="command", required=True))
    base = ["plan", "--model", "llama2-7b", "--gpu", "h100-80gb", "--nodes", "2", "--gpus-per-node", "8"]
    args = parser.parse_args([*base, "--seq-len", "4096", "--global-batch", "16", "--stages", "17,15", "--json"])
    assert args.func(args) == 0
    e = json.loads(capsys.readouterr().out)["evaluated"]  # forced stages pin pp: evaluated
    assert (e["pp"], e["stages"], e["cp"]) == (2, [17, 15], 1)
    args = parser.parse_args([*base, "--seq-len", "4096", "--global-batch", "16", "--layout", "tp=4,cp=2", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["evaluated"]["cp"] == 2
    args = parser.parse_args([*base, "--seq-len", "4096", "--global-batch", "16", "--layout", "dp_shard=16,zero=none"])
    assert args.func(args) == 2 and "plain data parallel is dp_replicate=16" in capsys.readouterr().err


def test_a_plan_s_layout_fields_are_parallel_dims_fields():
    """ParallelPlan declares no layout field of its own: each is ParallelDims's, with its default and its values."""
    dims_fields = {f.name: f.default for f in dataclasses.fields(ParallelDims)}
    assert LAYOUT_FIELDS == tuple(dims_fields) == tuple(ParallelPlan.model_fields)[: len(dims_fields)]
    assert {k: ParallelPlan.model_fields[k].default for k in dims_fields} == dims_fields
    dims = ParallelDims(
        tp=2, pp=2, dp_shard=2, sp=True, schedule="interleaved_1f1b", virtual_stages=2, stages=(1, 2, 2, 1)
    )
    plan = ParallelPlan.of(dims, mfu=0.4)
    assert plan.stages == [1, 2, 2, 1] and plan.dims() == dims
    with pytest.raises(ValueError, match="schedule"):
        ParallelPlan(schedule="zigzag")
