"""Planner: predictions against published runs, the Llama-2-70B seed check, search behaviour, spec adapter."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from nightloom.catalog import MODELS, get_gpu
from nightloom.parallel import LayoutError, ParallelDims
from nightloom.perf import flops_per_token
from nightloom.planner import PlanError, plan, plan_for_spec
from nightloom.planner.memory import GIB, memory_breakdown, usable_gib
from nightloom.planner.steptime import DEFAULT_EFFICIENCY, calibrated_efficiency
from nightloom.shape import ModelShape
from nightloom.spec import ParallelSpec
from nightloom.spec.load import parse_spec

#: the published runs the planner is checked against, kept in the repository (a clone has nothing beside it)
REF = Path(__file__).resolve().parents[3] / "datasets" / "reference" / "published_runs.csv"


def _rows():
    with open(REF) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


ALL_ROWS = _rows()
#: PTD-P (Narayanan et al. 2021, Table 1): the rows the efficiency factor was fitted on (1–4) and the first held-out ones
ROWS = [r for r in ALL_ROWS if r["source"] == "ptdp2021"]
#: Megatron-Core's weak-scaling rows the model predicts within 15%: from 16B up (h >= 6144). The 1.7B and 7.1B rows
#: (h 2048 and 4096, where the attention core is 33% and 17% of the counted FLOPs) are over-predicted by 37% and
#: 16%: the model runs the fused attention kernel at the matmul efficiency.
MCORE_CHECKED = [r for r in ALL_ROWS if r["source"] == "mcore2024" and int(r["hidden"]) >= 6144]
#: Llama 3 405B (Meta's own trainer, so a what-if: native_trainer=False, Megatron-style sequence-parallel saves):
#: every row is checked for throughput and the 8K ones for memory. The published stages are layers per pipeline
#: rank; Meta interleaved them into one-layer chunks, the first holding only the embedding and the last only the
#: head (§3.3.2): v=8, 128 chunks for 126 layers.
LLAMA3_ROWS = [r for r in ALL_ROWS if r["source"] == "llama3-2024"]


def _published_layout(row):
    """The published (Megatron) layout under nightloom's own trainer rules: PTD-P's GPT models tie embeddings
    across TP and PP, which the trainer runs too (one vocab-sharded matrix under TP, summed stage copies under PP)."""
    return plan(
        row["model"],
        row["gpu"],
        int(row["num_gpus"]) // 8,
        8,
        int(row["seq_len"]),
        int(row["global_batch"]),
        layout=f"tp={row['tp']},pp={row['pp']},dp={row['dp']},zero=none,sp=0,recompute={row['recompute']}",
        fused_attention=row["attention"] == "fused",  # PTD-P's stack stored the scores
    )


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["model"])
def test_published_layout_prediction_within_15_percent(row):
    """PTD-P's figures are HFU with full recompute and count the logit layer: compare in that same metric."""
    assert row["metric"] == "hfu" and row["recompute"] == "full"
    shape = MODELS[row["model"]]
    assert (shape.layers, shape.hidden, shape.heads) == (int(row["layers"]), int(row["hidden"]), int(row["heads"]))
    r = _published_layout(row)
    p = r.chosen
    assert (p.tp, p.pp, p.dp_replicate * p.dp_shard, p.zero, p.recompute) == (
        int(row["tp"]),
        int(row["pp"]),
        int(row["dp"]),
        "none",
        "full",
    )
    assert p.fits, p.explanation
    f_ptdp = flops_per_token(shape, int(row["seq_len"]), "full", hardware=True, lm_head=True)
    predicted = p.tokens_per_s * f_ptdp / int(row["num_gpus"]) / 1e12
    published = float(row["tflops_per_gpu"])
    assert abs(predicted / published - 1) <= 0.15, (row["model"], predicted, published)
    # and our own HFU figure (PaLM accounting, no logit layer) is the same throughput, slightly fewer FLOPs
    assert p.tflops_per_gpu_hardware <= predicted
    assert p.hfu == pytest.approx(p.tflops_per_gpu_hardware * 1e12 / 312e12)


def test_reference_rows_are_sourced_and_consistent():
    """Every published row names its source (URL and table) and its layout multiplies to its GPU count."""
    assert len(ALL_ROWS) >= 20
    for r in ALL_ROWS:
        assert r["source_url"].startswith("https://") and r["source_ref"], r
        assert int(r["tp"]) * int(r["pp"]) * int(r["dp"]) * int(r["cp"]) == int(r["num_gpus"]), r
        shape = MODELS[r["model"]]
        assert (shape.layers, shape.hidden, shape.heads) == (int(r["layers"]), int(r["hidden"]), int(r["heads"]))
        assert r["metric"] in ("hfu", "mfu_megatron", "mfu_palm") and r["attention"] in ("materialized", "fused")
        # the published utilisation and TFLOP/s agree on the datasheet peak (within the table's rounding)
        peak = get_gpu(r["gpu"]).peak_flops_bf16 / 1e12
        assert abs(float(r["tflops_per_gpu"]) / peak * 100 - float(r["pct_peak"])) < 1.0, r


@pytest.mark.parametrize("row", MCORE_CHECKED, ids=lambda r: r["model"])
def test_megatron_core_rows_within_15_percent(row):
    """Megatron-Core weak scaling (H100, seq 4096, fused attention): never fitted on; the published degrees are
    pinned, the rest (micro-batch, interleaving, recompute, ZeRO) is the planner's; compared in Megatron's own
    count (num_floating_point_operations at the table's commit: 6N + 12·L·h·s + 6·V·h per token)."""
    n = int(row["num_gpus"])
    r = plan(
        row["model"],
        row["gpu"],
        n // 8,
        8,
        int(row["seq_len"]),
        int(row["global_batch"]),
        layout=f"tp={row['tp']},pp={row['pp']},dp={row['dp']}",
        fused_attention=True,
        native_trainer=False,  # Megatron's runs: its sequence parallel saves the linears' inputs sharded
    )
    p = r.chosen
    assert p.fits, p.explanation
    assert "fused kernel" in " ".join(p.explanation)
    shape = MODELS[row["model"]]
    predicted = p.tokens_per_s * flops_per_token(shape, int(row["seq_len"]), lm_head=True) / n / 1e12
    assert abs(predicted / float(row["tflops_per_gpu"]) - 1) <= 0.15, (row["model"], predicted, row["tflops_per_gpu"])


def _llama3_layout(row, fused: bool = True, extra: str = ""):
    """Meta's published degrees and uneven stages as a what-if; fused attention (the default) unless told."""
    pins = f"tp={row['tp']},pp={row['pp']},dp={row['dp']},cp={row['cp']},zero={row['zero']}{extra}"
    if row["recompute"]:
        pins += f",recompute={row['recompute']}"
    n = int(row["num_gpus"])
    return plan(
        row["model"],
        row["gpu"],
        n // 8,
        8,
        int(row["seq_len"]),
        int(row["global_batch"]),
        layout=pins,
        stages=row["stages"],
        native_trainer=False,
        fused_attention=fused,
    ).chosen


@pytest.mark.parametrize("row", [r for r in LLAMA3_ROWS if r["cp"] == "1"], ids=lambda r: r["num_gpus"])
def test_llama3_405b_8k_layout_fits_80gb_without_recompute(row):
    """Meta ran 405B at 8K with TP8·PP16 and 7 + 14·8 + 7 stages, no activation checkpointing, in 80 GB (Grattafiori
    et al. 2024 §3.3.2). With SDPA's fused kernel the planner agrees; counting the s² scores (Korthikanti Table 2)
    it needed ~670 GiB."""
    p = _llama3_layout(row, extra=",v=1")
    assert p.recompute == "none" and (p.tp, p.pp, p.cp) == (8, 16, 1) and p.stages[0] == 7
    assert p.fits and p.memory_gib_per_gpu < usable_gib(80), p.explanation
    assert _llama3_layout(row, fused=False, extra=",v=1").memory_gib_per_gpu > 600  # the old count, for contrast


@pytest.mark.parametrize("row", [r for r in LLAMA3_ROWS if r["cp"] == "1"], ids=lambda r: r["num_gpus"])
def test_llama3_405b_8k_interleaved_within_15_percent(row):
    """Llama 3 405B at 8K on 8,192 and 16,384 GPUs in Meta's layout: the per-rank stages (7 + 14·8 + 7) as one-layer
    chunks, v=8, the first chunk the embedding alone and the last the head alone (interleaved 1F1B, bubble
    (p−1)/(v·m), Grattafiori et al. 2024 §3.3.2), within 15% of the published TFLOP/s per GPU (PaLM's count); one
    chunk per rank (bubble 15/32, 15/16) is not (−20%, −35%). Memory, counted as the schedule holds it
    (planner/inflight.py: rank 1 holds 141 layer-micro-batches at m=32, 128 at m=16) with Megatron-style saves
    (31.8·s·h/t bytes per layer): under the 80 GiB of an H100 on both; the 8,192-GPU one (78.9 GiB) is beyond
    the planner's 8% allocator headroom, so the planner itself would not pick it."""
    p = _llama3_layout(row, extra=",v=8")
    ranks = [int(x) for x in row["stages"].split(":")]
    assert p.virtual_stages == 8 and len(p.stages) == 128 and p.stages[0] == p.stages[-1] == 0
    assert [sum(p.stages[r::16]) for r in range(16)] == ranks
    shape = MODELS[row["model"]]
    predicted = p.tokens_per_s * flops_per_token(shape, int(row["seq_len"])) / int(row["num_gpus"]) / 1e12
    assert abs(predicted / float(row["tflops_per_gpu"]) - 1) <= 0.15, (predicted, row["tflops_per_gpu"])
    assert p.recompute == "none" and p.memory_gib_per_gpu < get_gpu(row["gpu"]).memory_gib, p.explanation
    one_chunk = _llama3_layout(row, extra=",v=1")
    assert one_chunk.tokens_per_s < p.tokens_per_s * 0.85  # the 1F1B bubble alone
    assert one_chunk.fits and p.memory_gib_per_gpu > one_chunk.memory_gib_per_gpu  # more in flight, interleaved
    # two-layer chunks (v=4) hold more than Meta's one-layer ones: rank 1 runs 2·14 + 3·16 forwards ahead, each 2 layers
    assert _llama3_layout(row, extra=",v=4").memory_gib_per_gpu >= p.memory_gib_per_gpu


def test_interleave_stages_splits_layers_per_rank():
    """A per-rank stage list becomes pp·v chunks (chunk j on rank j mod pp) with the lighter ends' layers taken
    from the model's first and last chunks, up to the whole chunk (Meta's one-layer chunks: an embedding-only first
    chunk, a head-only last one, which ParallelDims accepts); splits that would empty an inner chunk or lighten an
    inner rank: None."""
    from nightloom.catalog import get_model
    from nightloom.parallel import ParallelDims
    from nightloom.planner.stage_splits import interleave_stages

    meta = (7,) + (8,) * 14 + (7,)
    two = interleave_stages(meta, 2)
    assert two == (3,) + (4,) * 30 + (3,) and [sum(two[r::16]) for r in range(16)] == list(meta)
    assert interleave_stages(meta, 1) == meta
    eight = interleave_stages(meta, 8)  # Grattafiori et al. 2024 §3.3.2: 126 layers in 128 one-layer chunks
    assert eight == (0,) + (1,) * 126 + (0,) and [sum(eight[r::16]) for r in range(16)] == list(meta)
    dims = ParallelDims(tp=8, pp=16, grad_accum=16, virtual_stages=8, schedule="interleaved_1f1b", stages=eight)
    assert dims.check(get_model("llama3-405b"), 8192, None, native_trainer=False) == []
    assert interleave_stages(meta, 3) is None
    assert interleave_stages((6,) + (8,) * 14 + (7,), 8) is None  # 2 short in 1-layer chunks: an inner one empty
    assert interleave_stages((8, 7, 8, 8), 2) is None


@pytest.mark.parametrize("row", [r for r in LLAMA3_ROWS if r["cp"] != "1"], ids=lambda r: r["seq_len"])
def test_llama3_405b_128k_context_parallel_within_15_percent(row):
    """Llama 3.1 405B at 131,072 tokens with CP16: published 380 TFLOP/s per GPU in PaLM's count (full attention:
    with a causal half the published figure would imply more than the achieved matmul rate). Materialised scores
    made the softmax's HBM passes over s = 131,072 scores per token dominate (84 TFLOP/s predicted). The search,
    free in v, micro-batch and recompute, picks Meta's one-layer chunks (v=8) with full recompute: 432 (+13.7%);
    two-layer chunks (v=4): 395 (+3.9%). Meta's CP all-gathers K,V before the attention, exposed (§3.3.2):
    without that term (ring hops hidden behind the attention) the same pick came out at 452 (+19%)."""
    shape = MODELS[row["model"]]

    def tflops(p):
        return p.tokens_per_s * flops_per_token(shape, int(row["seq_len"])) / int(row["num_gpus"]) / 1e12

    p = _llama3_layout(row)
    assert p.cp == 16 and p.fits and p.virtual_stages == 8 and p.stages[0] == p.stages[-1] == 0
    predicted = tflops(p)
    assert abs(predicted / float(row["tflops_per_gpu"]) - 1) <= 0.15, (predicted, row["tflops_per_gpu"])
    assert p.tflops_per_gpu_model == pytest.approx(predicted)
    assert "all-gathered over the cp group" in " ".join(p.explanation) and "exposed" in " ".join(p.explanation)
    two = _llama3_layout(row, extra=",v=4")
    assert abs(tflops(two) / float(row["tflops_per_gpu"]) - 1) <= 0.15, tflops(two)


def test_fused_attention_stores_no_scores_and_skips_the_softmax_traffic():
    """A fused kernel drops Korthikanti's 5·a·s/h term and the softmax's HBM passes, so at a long sequence it
    needs less memory and less time than materialised scores; the matmul count follows FlashAttention-2."""
    from nightloom.catalog import get_gpu as gpu_of
    from nightloom.planner.steptime import step_time

    s = MODELS["llama3-8b"]
    c = ParallelDims(tp=8, pp=1, dp_replicate=1, dp_shard=1, sp=True, micro_batch=1, grad_accum=1, recompute="none")
    mat, fused = (memory_breakdown(s, c, 8192, fused_attention=f).activations_gib for f in (False, True))
    assert fused < mat / 5  # at s=8192 the scores (5·a·s/h = 320 per s·b·h) dwarf the 34 of the rest
    h100 = gpu_of("h100-80gb")
    slow, fast = (step_time(s, c, 8192, h100, 8, 0.58, fused_attention=f) for f in (False, True))
    assert fast.hbm_s < slow.hbm_s and fast.matmul_s < slow.matmul_s
    # 7/12 of the attention core's counted FLOPs: the difference is 5·a·d·s per token and layer
    core = s.heads * s.head_dim * 8192 * s.layers * 8192 / c.tp
    assert slow.matmul_s - fast.matmul_s == pytest.approx(5 * core / (0.58 * h100.peak("bf16")), rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r["model"])
def test_planner_choice_fits_and_is_no_slower_than_published(row):
    pub = _published_layout(row).chosen
    r = plan(
        row["model"],
        row["gpu"],
        int(row["num_gpus"]) // 8,
        8,
        int(row["seq_len"]),
        int(row["global_batch"]),
        fused_attention=row["attention"] == "fused",
    )
    c = r.chosen
    assert c.fits and c.memory_gib_per_gpu <= r.usable_memory_gib
    assert c.tokens_per_s >= pub.tokens_per_s * (1 - 1e-9), (c.layout(), pub.layout())
    assert c.world_size == int(row["num_gpus"])
    assert c.micro_batch * c.grad_accum * c.dp_replicate * c.dp_shard == int(row["global_batch"])


LLAMA70 = dict(model="llama2-70b", gpu="a800-80gb", nodes=8, gpus_per_node=4, seq_len=4096, global_batch=32)


def test_llama2_70b_replicated_states_do_not_fit():
    for rc in ("none", "selective", "full"):
        r = plan(**LLAMA70, layout=f"tp=4,pp=2,dp=4,zero=none,recompute={rc}")
        assert r.chosen.fits is False
        m = r.chosen.memory
        # 8.6e9 params per GPU on stage 0 × 16 B of replicated Adam states alone exceed 80 GiB
        assert m.weights_gib + m.grads_gib + m.optimizer_gib > 120
        assert r.min_memory_gib > r.usable_memory_gib


def test_llama2_70b_fsdp_over_dp_shards_states_not_accumulated_grads():
    """FSDP over 4 shards the states, but the trainer's FSDP2 keeps each micro-batch's unsharded gradients in fp32
    until the last one's reduce-scatter (accum 8 under PP2): 70B / (4·2) params · 4 B on top, so it does not fit;
    reduce-scattering every micro-batch (parallel.reduce_each_micro_batch, chosen where it is not pinned) holds
    none of them."""
    r = plan(**LLAMA70, layout="tp=4,pp=2,dp=4,zero=fsdp,recompute=full,reduce_each=0")
    c = r.chosen
    assert (c.tp, c.pp, c.dp_shard, c.zero, c.grad_accum) == (4, 2, 4, "fsdp", 8)
    assert c.memory.optimizer_gib < 30  # 12 B/param / 4
    # bf16 weights and grads sharded over 4 (2 B each), plus the stage's whole gradients at 4 B: 2 + 4·4 = 9×
    assert c.memory.grads_gib == pytest.approx(9 * c.memory.weights_gib) and not c.fits
    each = plan(**LLAMA70, layout="tp=4,pp=2,dp=4,zero=fsdp,recompute=full").chosen
    assert each.reduce_each_micro_batch and each.memory.grads_gib == pytest.approx(each.memory.weights_gib)
    assert "sharded over dp_shard=4" in " ".join(c.explanation)


def test_llama2_70b_planner_pick_fits_and_beats_pinned():
    auto = plan(**LLAMA70).chosen
    pinned = plan(**LLAMA70, layout="tp=4,pp=2,dp=4,zero=fsdp").chosen
    assert auto.fits and auto.tokens_per_s >= pinned.tokens_per_s
    assert auto.tp <= 4  # TP stays inside a 4-GPU node
    # replicated Adam states cannot fit 70B on 32 × 80 GB at any TP·PP within a node: sharded, or no data parallel
    assert auto.zero == "fsdp" or auto.dp_replicate * auto.dp_shard == 1, auto.layout()
    assert 0.2 < auto.mfu < 0.6 and auto.hfu >= auto.mfu


def test_memory_formulas_follow_korthikanti():
    s = MODELS["gpt-18.4b"]
    base = dict(tp=8, pp=1, dp_replicate=1, dp_shard=4, micro_batch=1, virtual_stages=1, grad_accum=1)
    acts = {}
    for sp in (False, True):
        for rc in ("none", "selective", "full"):
            for fused in (False, True):
                c = ParallelDims(**base, sp=sp, recompute=rc)
                acts[sp, rc, fused] = memory_breakdown(s, c, 2048, fused_attention=fused).activations_gib
    # Table 2 (materialised scores)
    assert acts[True, "none", False] < acts[False, "none", False]  # SP shards the 10·sbh part
    assert acts[True, "full", False] < acts[True, "selective", False] < acts[True, "none", False]
    # a fused kernel stores no scores: selective recompute saves only the kernel's log-sum-exp (4·a/t per token)
    saved = acts[True, "none", True] - acts[True, "selective", True]
    # (every layer but the one being recomputed, briefly whole again in backward)
    assert saved * GIB == pytest.approx((s.layers - 1) * 2048 * 4 * s.heads / 8, rel=1e-6)
    assert acts[True, "none", True] < acts[True, "none", False]


def test_world_size_override_keeps_global_batch():
    spec = parse_spec(
        {
            "name": "t",
            "dataset": {"path": "x", "sample": True},
            "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu_type": "h100-80gb"},
            "model": {"name": "llama2-7b"},
            "train": {"seq_len": 4096, "global_batch": 64},
        }
    )
    full = plan_for_spec(spec).chosen
    fewer = plan_for_spec(spec, world_size=16).chosen
    for p, ws in ((full, 32), (fewer, 16)):
        assert p.world_size == ws and p.fits
        assert p.micro_batch * p.grad_accum * p.dp_replicate * p.dp_shard == 64


def test_explicit_spec_layout_is_evaluated_not_searched():
    spec = parse_spec(
        {
            "name": "t",
            "dataset": {"path": "x", "sample": True},
            "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "a100-80gb"},
            "model": {"name": "llama2-13b"},
            "train": {"seq_len": 4096, "global_batch": 32},
            "parallel": {"tp": 4, "pp": 2, "micro_batch": 1, "recompute": "full"},
        }
    )
    assert isinstance(spec.parallel, ParallelSpec)
    r = plan_for_spec(spec)
    c = r.chosen
    assert r.evaluated and (c.tp, c.pp, c.dp_shard, c.zero, c.recompute, c.micro_batch) == (4, 2, 2, "fsdp", "full", 1)
    assert c.grad_accum == 16 and c.fits is True and c.mfu is not None


def test_explicit_spec_bad_divisibility_is_a_layout_error():
    spec = parse_spec(
        {
            "name": "t",
            "dataset": {"path": "x", "sample": True},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu_type": "a100-80gb"},
            "model": {"name": "llama2-7b"},
            "parallel": {"tp": 8, "pp": 1, "dp_shard": 1},
        }
    )
    assert plan_for_spec(spec).chosen.tp == 8
    spec.parallel = ParallelSpec(tp=1, pp=3, dp_shard=-1)
    with pytest.raises(LayoutError, match=r"world size 8 is not divisible by .*= 3"):
        plan_for_spec(spec)


def test_cpu_demo_prefers_pure_data_parallel_and_predicts_nothing():
    spec = parse_spec(
        {
            "name": "demo",
            "dataset": {"path": "x", "sample": True},
            "cluster": {"nodes": 2, "gpus_per_node": 2, "gpu_type": "cpu"},
            "model": {"name": "tiny"},
            "train": {"seq_len": 128, "global_batch": 8},
        }
    )
    r = plan_for_spec(spec)
    c = r.chosen
    assert (c.tp, c.pp, c.dp_replicate * c.dp_shard, c.zero) == (1, 1, 4, "none")
    assert c.micro_batch * c.grad_accum * 4 == 8
    assert c.mfu is None and c.fits is None and c.memory_gib_per_gpu is None and not r.predicted
    assert "not predicted" in c.explanation[0]
    assert c.dims().check(MODELS["tiny"], 128, 8, device_type="cpu") == []  # a runnable layout
    # re-plan on 2 ranks after a node is lost: same global batch
    c2 = plan_for_spec(spec, world_size=2).chosen
    assert c2.world_size == 2 and c2.micro_batch * c2.grad_accum * 2 == 8


def test_cpu_tp_never_exceeds_ranks_per_node():
    r = plan("small", "cpu", 2, 2, 128, 4, layout="dp=1")
    assert r.chosen.tp <= 2 and r.chosen.world_size == 4


def test_calibration_moves_efficiency_bounded_and_is_explained():
    base = plan("llama2-7b", "h100-80gb", 1, 8, 4096, 64).chosen
    slow = plan("llama2-7b", "h100-80gb", 1, 8, 4096, 64, calibration=0.8).chosen
    assert slow.mfu < base.mfu
    assert any("calibrated from the ledger" in x for x in slow.explanation)
    assert calibrated_efficiency(10.0) == pytest.approx(min(0.95, DEFAULT_EFFICIENCY * 1.5))
    assert calibrated_efficiency(0.01) == pytest.approx(DEFAULT_EFFICIENCY * 0.5)


def test_model_too_big_reports_min_memory():
    r = plan("llama3-405b", "rtx-4090", 1, 8, 4096, 8)
    assert r.chosen.fits is False and r.min_memory_gib > 24
    assert r.rejected and all(
        "does not fit" in x.reason or "does not divide" in x.reason or "span" in x.reason for x in r.rejected
    )
    spec = parse_spec(
        {
            "name": "t",
            "dataset": {"path": "x", "sample": True},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu_type": "rtx-4090"},
            "model": {"name": "llama3-405b"},
        }
    )
    with pytest.raises(PlanError, match=r"smallest needs [0-9.]+ GiB per GPU"):
        plan_for_spec(spec)


def test_inconsistent_shape_is_a_clear_error():
    with pytest.raises(ValueError, match=r"hidden \(1000\) is not divisible by heads \(3\)"):
        ModelShape("bad", 2, 1000, 3, 3, 4000, 100, 128)


def test_no_valid_layout_names_the_reasons():
    with pytest.raises(PlanError, match="does not divide"):
        plan("tiny", "a100-80gb", 1, 3, 128, 3, layout="tp=3")


def test_rejections_give_a_reason_per_family():
    r = plan(**LLAMA70)
    reasons = {x.layout: x.reason for x in r.rejected}
    assert reasons["TP4·PP2·DP4"].startswith("does not fit by ")  # replicated states
    assert reasons["TP4·PP4·FSDP2"].startswith("slower by ")
    assert "does not divide layers (80)" in reasons["TP1·PP32·*"]
    assert r.considered > r.pruned > 0 and len(r.alternatives) == 5
    assert all(a.tokens_per_s <= r.chosen.tokens_per_s for a in r.alternatives)
