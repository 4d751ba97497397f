"""The planner's activation memory is what the trainer really holds: per layer, the bytes autograd saves for one
block of nightloom's model (measured with saved-tensor hooks); per pipeline rank, the micro-batches torch's own
interleaved schedule keeps in flight."""

from __future__ import annotations

import pytest
import torch

from nightloom.catalog import MODELS
from nightloom.planner.activations import saved_bytes_per_token
from nightloom.planner.inflight import in_flight_layers
from nightloom.train.model import build_model

SEQ = 256


def _small(name: str, **extra):
    """A 512-wide, 2-layer model of the family (its GQA ratio, MLP ratio, norms and attention kinds kept)."""
    big = MODELS[name]
    heads = 32
    kv = max(1, heads * big.kv_heads // big.heads)
    ffn = int(512 * big.ffn_hidden / big.hidden)
    moe = dict(expert_ffn_hidden=128, num_experts=8, experts_per_token=2) if big.moe else {}
    head_dim = dict(explicit_head_dim=None) if big.explicit_head_dim else {}
    return big.with_(
        hidden=512, heads=heads, kv_heads=kv, ffn_hidden=ffn, layers=2, vocab=1000, **moe | head_dim | extra
    )


def _measured_bytes_per_token(shape, layer: int, recompute: str) -> float:
    """Bytes one block saves for backward over SEQ tokens in bf16: every saved tensor's storage once, parameters,
    buffers (RoPE tables) and the block's input (saved by the caller's graph as well, so counted here once) apart."""
    torch.manual_seed(0)
    model = build_model(shape, SEQ, device="cpu").to(torch.bfloat16)
    model.set_recompute(recompute)
    block = model.layers[str(layer)]
    x = torch.randn(1, SEQ, shape.hidden, dtype=torch.bfloat16, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, *model._layer_rope(layer))
    # no backward: the hooks count at save time, in the forward (a bf16 backward on CPU took ~75% of this file's
    # time and counted nothing); a grad_fn on the output says autograd recorded the forward, saving what it needs
    assert out.requires_grad and out.grad_fn is not None
    return sum(seen.values()) / SEQ


FAMILIES = {
    "llama3-405b": dict(),  # GQA 16:1, SwiGLU 3.25h
    "qwen3-8b": dict(),  # per-head q/k norms, head_dim 128 over a narrow hidden
    # post-norms, GeGLU; layer 0 slides (a mask: K/V repeated to every head), layer 1 is global
    "gemma3-27b": dict(sliding_window=64, layer_types=("sliding_attention", "full_attention")),
    "gpt-18.4b": dict(),  # plain GELU MLP, MHA
    "qwen3-30b-a3b": dict(),  # routed experts
    # latent attention (low-rank query, values narrower than keys, YaRN), a dense layer 0, a shared expert
    "deepseek-v3": dict(
        explicit_head_dim=48,
        qk_rope_head_dim=16,
        kv_lora_rank=64,
        q_lora_rank=96,
        v_head_dim=32,
        router_groups=2,
        router_topk_groups=1,
        dense_layers=(0,),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_planner_counts_what_a_block_saves(name, recompute):
    """Per token, the mean over the model's layers (Gemma: a sliding one and a global one) within 0.1% of what the
    blocks save; routed layers also keep int64 routing indices (8 bytes per copy, not counted): within 2%."""
    shape = _small(name, **FAMILIES[name])
    measured = sum(_measured_bytes_per_token(shape, i, recompute) for i in range(shape.layers)) / shape.layers
    predicted = saved_bytes_per_token(shape, SEQ, 1, False, recompute)
    assert predicted == pytest.approx(measured, rel=0.02 if shape.moe else 1e-3), (name, recompute)


def _torch_peaks(chunks: tuple[int, ...], pp: int, m: int) -> tuple[int, ...]:
    """Peak layers × micro-batches per rank in torch's own ScheduleInterleaved1F1B op order (its per-rank action
    lists, computed without a process group)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    v, peaks = len(chunks) // pp, []
    for rank in range(pp):
        sched = object.__new__(ScheduleInterleaved1F1B)
        sched.n_local_stages, sched.pp_group_size, sched._n_microbatches, sched.rank = v, pp, m, rank
        sched.number_of_rounds = max(1, m // pp)
        sched.microbatches_per_round = m // sched.number_of_rounds
        held = peak = 0
        for action in filter(None, sched._calculate_single_rank_operations(rank)):
            sign = 1 if action.computation_type == _ComputationType.FORWARD else -1
            held += sign * chunks[action.stage_index]
            peak = max(peak, held)
        assert held == 0
        peaks.append(peak)
    return tuple(peaks)


META8 = (0,) + (1,) * 126 + (0,)  # Llama 3 405B's one-layer chunks, embedding-only first, head-only last
META4 = (1,) + (2,) * 62 + (1,)


@pytest.mark.parametrize(
    "chunks,pp,m",
    [(META8, 16, 32), (META8, 16, 16), (META4, 16, 32), ((1, 2, 2, 1), 2, 4), ((3,) * 12, 4, 6), ((2,) * 8, 4, 8)],
)
def test_interleaved_in_flight_matches_torchs_schedule(chunks, pp, m):
    assert in_flight_layers(chunks, pp, m, "interleaved_1f1b") == _torch_peaks(chunks, pp, m)


def test_in_flight_without_interleaving():
    """1F1B: rank r holds min(pp − r, m) micro-batches of its layers; GPipe all m; no pipeline: one."""
    assert in_flight_layers((7, 8, 8, 7), 4, 8, "1f1b") == (28, 24, 16, 7)
    assert in_flight_layers((7, 8, 8, 7), 4, 2, "1f1b") == (14, 16, 16, 7)
    assert in_flight_layers((7, 8, 8, 7), 4, 8, "gpipe") == (56, 64, 64, 56)
    assert in_flight_layers((32,), 1, 8, "1f1b") == (32,)
    # Meta's rank 1 (8 one-layer chunks, 2·14 + 7·16 forwards before its first backward) holds more than rank 0
    peaks = in_flight_layers(META8, 16, 32, "interleaved_1f1b")
    assert peaks[:2] == (112, 141) and max(peaks) == 141


def test_fp32_training_saves_twice_the_bytes():
    """The counts are of 16-bit activations; an fp32 run (the CPU default) saves every tensor at 4 bytes."""
    from nightloom.parallel import ParallelDims
    from nightloom.planner.memory import GIB, logit_bytes, memory_breakdown

    shape, c = MODELS["llama3-8b"], ParallelDims(dp_shard=2, micro_batch=2, grad_accum=2, recompute="none")
    logits = logit_bytes(shape, c, 4096) / GIB  # fp32 either way (the loss upcasts)
    bf16, fp32 = (memory_breakdown(shape, c, 4096, p).activations_gib - logits for p in ("bf16", "fp32"))
    assert fp32 == pytest.approx(2 * bf16)
