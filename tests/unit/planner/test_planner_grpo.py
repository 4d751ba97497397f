"""train.task grpo priced by the planner: a step is generation + scoring + training (planner/post_training.py),
generation on the inference roofline (planner/generation.py): a compute-bound prefill, a decode bound by the
weight and KV-cache bytes read per token over HBM bandwidth (TP shards the weights, FSDP2 gathers them once), the
KV cache in the memory model; each part equal to its formula, and the KV cache equal to what the native rollout's
cache allocates on a tiny model."""

from __future__ import annotations

import pytest
import torch

from nightloom.catalog import MODELS, get_gpu
from nightloom.parallel import ParallelDims
from nightloom.perf import count_params
from nightloom.planner import PlanError, PostTraining, plan, plan_for_spec
from nightloom.planner.generation import generation, kv_bytes_per_token, no_grad_forward_s
from nightloom.planner.memory import FRAMEWORK_OVERHEAD_GIB, GIB
from nightloom.planner.steptime import DEFAULT_EFFICIENCY, step_time
from nightloom.shape import ModelShape
from nightloom.spec import RunSpec

H100 = get_gpu("h100-80gb")
EFF = DEFAULT_EFFICIENCY
SHAPE = MODELS["llama3-8b"]  # 32 layers, 8 KV heads of 128: 128 KiB of bf16 K and V a token


def _spec(parallel="auto", seq: int = 1024, lora=None, **grpo) -> RunSpec:
    grpo = {"prompts_per_step": 64, "num_generations": 8, "max_completion_tokens": 512, **grpo}
    train = {"task": "grpo", "seq_len": seq, "steps": 100, "grpo": grpo, "lora": lora}
    cluster = {"nodes": 1, "gpus_per_node": 8, "gpu_type": "h100-80gb"}
    data = {"name": "g", "dataset": {"path": "d"}, "model": {"name": "llama3-8b"}, "cluster": cluster}
    return RunSpec.model_validate({**data, "train": train, "parallel": parallel})


def test_the_kv_cache_is_what_the_native_rollout_allocates():
    """A tiny GQA model (4 heads, 2 KV heads, fp32) prefills 3 prompts into the rollout's own KVCache sized for
    prompt + completion: its K and V tensors hold exactly the planner's bytes."""
    from nightloom.train.model import Transformer
    from nightloom.train.rollout.kv_cache import KVCache, cached_logits

    shape = ModelShape(name="tiny", layers=3, hidden=64, heads=4, kv_heads=2, ffn_hidden=176, vocab=97, max_seq=64)
    rows, prompt, completion = 3, 7, 9
    torch.manual_seed(0)
    model = Transformer(shape, 64).eval()
    cache = KVCache(pad=torch.zeros(rows, dtype=torch.long), max_len=prompt + completion)
    with torch.no_grad():
        cached_logits(model, torch.randint(1, shape.vocab, (rows, prompt)), cache)
    held = sum(t.nbytes for t in [*cache.keys.values(), *cache.values.values()])
    assert held == rows * (prompt + completion) * kv_bytes_per_token(shape, 1, 4) == 3 * 16 * 3 * 2 * 2 * 16 * 4
    gen = generation(shape, ParallelDims(), rows, prompt, completion, H100, 8, EFF, "fp32")
    assert gen.kv_bytes == held


def test_decode_is_weight_and_kv_bytes_over_hbm_bandwidth_until_compute_bound():
    """One rank, 8 rows, 512 prompt tokens, 257 completion tokens: 256 cached steps, each reading the 16-bit
    weights and the KV cache at its mean length (512 + 128.5 tokens) at the H100's 3.35 TB/s; batching amortizes
    the weights (64 rows cost far less than 8 × 8), and 1,024 rows of a short context are compute-bound."""
    gen = generation(SHAPE, ParallelDims(), 8, 512, 257, H100, 8, EFF, "bf16")
    weights = count_params(SHAPE) * 2
    kv = 2 * 32 * 8 * 128 * 2
    assert gen.decode_bound == "memory"
    assert gen.weight_bytes == pytest.approx(weights)
    assert gen.decode_s == pytest.approx(256 * (weights + 8 * (512 + 128.5) * kv) / 3.35e12)
    prefill_flops = 8 * 512 * (2 * count_params(SHAPE, include_embeddings=False) + 4 * 32 * 32 * 128 * 512)
    assert gen.prefill_s == pytest.approx(prefill_flops / (EFF * 989e12), rel=0.01)  # + the last token's head
    assert generation(SHAPE, ParallelDims(), 64, 512, 257, H100, 8, EFF, "bf16").decode_s < 2 * gen.decode_s
    assert generation(SHAPE, ParallelDims(), 1024, 16, 17, H100, 8, EFF, "bf16").decode_bound == "compute"


def test_tp_shards_the_weights_read_and_fsdp_gathers_them_once():
    one = generation(SHAPE, ParallelDims(), 8, 512, 257, H100, 8, EFF, "bf16")
    tp2 = generation(SHAPE, ParallelDims(tp=2), 8, 512, 257, H100, 8, EFF, "bf16")
    assert tp2.weight_bytes == pytest.approx(one.weight_bytes / 2, rel=1e-3)  # norms stay whole
    assert tp2.kv_bytes == one.kv_bytes / 2
    assert tp2.decode_s < one.decode_s and one.gather_s == 0
    fsdp = generation(SHAPE, ParallelDims(dp_shard=8), 8, 512, 257, H100, 8, EFF, "bf16")
    assert fsdp.weight_bytes == one.weight_bytes  # gathered whole for the rollout
    ring = 7 / 8 * one.weight_bytes / H100.intra_node_bw + 7 * H100.intra_node_latency_s
    assert fsdp.gather_s == pytest.approx(ring)


@pytest.mark.parametrize("iterations", [1, 4])
def test_a_step_is_generation_scoring_and_training(iterations):
    """64 prompts × 8 completions of 512 tokens after 512 prompt tokens on FSDP8: training is the planner's step
    of the 512 sequences of 1,024 tokens; each rank generates its 64 completions every `iterations` steps."""
    r = plan_for_spec(_spec({"tp": 1, "dp_shard": -1, "micro_batch": 4}, iterations=iterations), require_fit=False)
    c, split = r.chosen.dims(), r.post_training
    train = step_time(SHAPE, c, 1024, H100, 8, EFF)
    gen = generation(SHAPE, c, 64, 512, 512, H100, 8, EFF, "bf16")
    assert c.grad_accum == 512 // 8 // 4
    assert split.training_s == pytest.approx(train.step_s)
    assert split.generation_s == pytest.approx(gen.total_s) and split.scoring_s == split.reference_s == 0
    assert r.chosen.step_time_s == pytest.approx(train.step_s + gen.total_s / iterations)
    per = split.per_step
    assert per["generation"] == pytest.approx(gen.total_s / iterations) and per["training"] == split.training_s
    line = next(x for x in r.chosen.explanation if x.startswith("grpo step"))
    assert all(word in line for word in ("generation", "scoring", "training", "decode", "memory-bound"))
    from flows.commands.plan import to_json  # `nightloom plan --json` carries the split

    assert to_json(r)["post_training"]["generation_s"] == split.generation_s


def test_beta_adds_the_references_forward_to_every_step():
    """beta > 0 (LoRA: the adapters off): every step's training first runs a no-grad forward of each micro-batch
    of completions (train/rollout/step.py), not once per rollout."""
    layout = {"tp": 1, "dp_shard": -1, "micro_batch": 4}
    r = plan_for_spec(_spec(layout, lora={"rank": 16}, beta=0.04, iterations=2), require_fit=False)
    c, split = r.chosen.dims(), r.post_training
    assert split.reference_s == pytest.approx(no_grad_forward_s(SHAPE, c, 64, 4, 1024, H100, 8, EFF, "bf16"))
    assert split.scoring_s == 0
    assert r.chosen.step_time_s == pytest.approx(split.training_s + split.reference_s + split.generation_s / 2)
    assert split.per_step["training"] == pytest.approx(split.training_s + split.reference_s)


def test_the_rollout_counts_in_memory_when_it_needs_more_than_training():
    """16 completions of 2,048 tokens after 2,048 prompt tokens for 64 prompts on FSDP8: each rank's 128 rows
        hold a 64 GiB KV cache, plus the prefill's MLP and the gathered weights: the activations column is the
        rollout's, not the training step's (about 19 GiB at one sequence per forward). A few short rollouts on TP8
    without FSDP: the training step's."""
    layout = {"tp": 1, "dp_shard": -1, "micro_batch": 1}
    r = plan_for_spec(_spec(layout, seq=4096, num_generations=16, max_completion_tokens=2048), require_fit=False)
    c, split, mem = r.chosen.dims(), r.post_training, r.chosen.memory
    gen = generation(SHAPE, c, 128, 2048, 2048, H100, 8, EFF, "bf16")
    assert gen.kv_bytes == 128 * 4096 * 2 * 32 * 8 * 128 * 2 == 64 * GIB
    gathered = gen.weight_bytes / GIB - (mem.overhead_gib - FRAMEWORK_OVERHEAD_GIB)
    assert split.rollout_gib == pytest.approx((gen.kv_bytes + gen.working_bytes) / GIB + gathered)
    assert mem.activations_gib == split.rollout_gib > 4 * split.training_activations_gib
    assert r.chosen.fits is False
    few = _spec({"tp": 8, "micro_batch": 8}, prompts_per_step=8, num_generations=2, max_completion_tokens=64)
    short = plan_for_spec(few, require_fit=False)  # 16 rows on TP8: a 0.25 GiB KV cache, nothing gathered
    assert short.post_training.rollout_gib < short.post_training.training_activations_gib
    assert short.chosen.memory.activations_gib == short.post_training.training_activations_gib


def test_auto_plans_grpo_without_pipeline_context_or_sequence_parallel():
    chosen = plan_for_spec(_spec()).chosen
    assert (chosen.pp, chosen.cp, chosen.sp) == (1, 1, False), chosen.layout()
    assert chosen.fits


def test_auto_keeps_every_group_on_one_data_parallel_rank():
    """4 prompts on 8 GPUs: the trainer refuses a dp that does not divide prompts_per_step, so the search keeps
    dp at 4 or below however many completions there are."""
    chosen = plan_for_spec(_spec(prompts_per_step=4, num_generations=16), require_fit=False).chosen
    assert 4 % (chosen.dp_replicate * chosen.dp_shard) == 0, chosen.layout()
    fsdp8 = dict(layout="tp=1,fsdp=8,mb=1")
    with pytest.raises(PlanError, match="no valid layout"):
        plan(
            "llama3-8b",
            "h100-80gb",
            1,
            8,
            1024,
            64,
            task=PostTraining("grpo", prompts=4, group=16, completion=512),
            **fsdp8,
        )
    ok = plan(
        "llama3-8b",
        "h100-80gb",
        1,
        8,
        1024,
        128,
        task=PostTraining("grpo", prompts=8, group=16, completion=512),
        **fsdp8,
    )
    assert ok.chosen.dp_shard == 8
