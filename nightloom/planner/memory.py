"""Memory per GPU on the busiest pipeline stage: states under the chosen sharding plus activations in flight.

States (ZeRO, Rajbhandari et al. 2020 §3.1): mixed-precision Adam holds 2 (bf16 weights) + 2 (grads) + 12 (fp32 master, m, v)
bytes per parameter, fp32 training 4 + 4 + 8; ZeRO-3/FSDP divides all of them by the shard degree and adds the
gathered working set (with pipeline parallelism FSDP2 must keep the stage gathered, reshard_after_forward=False).

Activations per layer and micro-batch: planner/activations.py (what the trainer saves, or Korthikanti et al.
2022 Table 2 for materialised scores); how many micro-batches each pipeline rank holds at its peak: planner/
inflight.py (GPipe all, 1F1B pp − r, interleaved simulated in the trainer's op order). The last stage adds the logits
(fp32, vocab sharded by TP with loss parallel), or where the trainer fuses the loss with the head (pp = tp = cp = 1,
`chunked_ce`) a few fp32 chunks of them.
"""

from __future__ import annotations

from functools import lru_cache

from nightloom.parallel import MemoryBreakdown, ParallelDims
from nightloom.perf import attention_params, expert_params, mlp_params
from nightloom.planner.activations import activation_bytes_per_layer
from nightloom.planner.offload import host_bytes as offload_host_bytes
from nightloom.planner.offload import working_bytes as offload_working_bytes
from nightloom.planner.stage_memory import chunk_input_bytes, rank_bytes
from nightloom.shape import ModelShape

GIB = 1024**3
#: CUDA context, NCCL/HCCL buffers, cuBLAS workspaces: a fixed cost per GPU.
FRAMEWORK_OVERHEAD_GIB = 1.5
#: Fraction of device memory kept free for the caching allocator's fragmentation (torch's default allocator, no
#: expandable_segments, as the trainer runs). Published measurements bound it: GMLake (Guo et al., ASPLOS 2024,
#: abstract) measured 9.2 GB lost on average (up to 25 GB) over eight LLMs on A100-80GB under recompute, ZeRO,
#: offload and LoRA, 11.5% of the card; one 70B OOM report shows 1.83 of 78.09 GiB reserved but unallocated, 2.3%
#: (vllm-project/compressed-tensors#587); Answer.AI's Llama-2-70B QLoRA ran on 2 × 24 GB (tests/unit/planner/
#: test_planner_qlora.py), which GMLake's 11.5% would refuse (it needs <= 10.8%). 8% sits inside that range.
HEADROOM_FRACTION = 0.08
#: Bytes per parameter of the unsharded gradients FSDP2 accumulates between micro-batches: the trainer reduces in
#: fp32 (MixedPrecisionPolicy(reduce_dtype=float32)) and skips the reduce-scatter until the last micro-batch (its
#: set_requires_gradient_sync, and torch.distributed.pipelining's backward_maybe_with_nosync under PP), so FSDPParam
#: keeps each unsharded gradient upcast to fp32 (unsharded_accumulated_grad) from the first backward to the last.
ACCUM_GRAD_BYTES = 4
#: Bytes per element of the saved fp32 logits (upcast for the cross-entropy) on the last stage.
LOGIT_BYTES = 4
#: Tokens per chunk of the trainer's chunked cross-entropy (train/loss.py).
CE_CHUNK_TOKENS = 1024
#: fp32 (chunk, vocab) tensors alive at once in a chunk's backward: recomputed logits, softmax, their gradient.
CE_CHUNK_TENSORS = 3


def chunked_ce(pp: int, tp: int, cp: int) -> bool:
    """Does the trainer fuse the loss with the head, chunk by chunk (train/loss.py)? Only where the head is
    whole on the rank and outside a pipeline schedule: pp = tp = cp = 1 (FSDP2 and replicate are fine)."""
    return pp == 1 and tp == 1 and cp == 1


def logit_bytes(shape: ModelShape, c: ParallelDims, seq: int) -> float:
    """The logits the last stage holds for one micro-batch: fp32 for every token (vocab sharded by TP with loss
    parallel), or with the chunked loss only CE_CHUNK_TENSORS fp32 chunks of CE_CHUNK_TOKENS tokens."""
    tokens = seq * c.micro_batch / c.cp
    if chunked_ce(c.pp, c.tp, c.cp):
        return LOGIT_BYTES * CE_CHUNK_TENSORS * min(CE_CHUNK_TOKENS, tokens) * shape.vocab
    return LOGIT_BYTES * tokens * shape.vocab / c.tp


@lru_cache(maxsize=1024)
def layer_params(shape: ModelShape, tp: int, ep: int = 1) -> float:
    """Parameters of one transformer layer held by one TP rank (an MoE model's mean layer): the matrices and their
    column-parallel biases split, the rest (norms, q/k norms, row-parallel biases, the router) replicated; routed
    experts split over tp·ep (expert TP = TP, Megatron-Core's default). The totals are perf.py's (their one owner)."""
    h = shape.hidden
    attn = attention_params(shape)
    attn_rep = 0 if shape.kv_lora_rank else h * shape.o_bias + 2 * shape.head_dim * shape.qk_norm
    norms = 2 * h + 2 * h * shape.post_norms
    dense_mlp = mlp_params(shape, shape.ffn_hidden)
    mlp_rep = h * shape.mlp_bias
    per_layer = (attn - attn_rep) / tp + attn_rep + norms
    if not shape.moe:
        return per_layer + (dense_mlp - mlp_rep) / tp + mlp_rep
    L, moe = shape.layers, shape.moe_layers
    one = mlp_params(shape, shape.expert_ffn_hidden)
    dense_part = (L - moe) * ((dense_mlp - mlp_rep) / tp + mlp_rep)
    moe_part = moe * (h * shape.num_experts + shape.shared_experts * ((one - mlp_rep) / tp + mlp_rep))
    return per_layer + (dense_part + moe_part) / L + layer_expert_params(shape, tp, ep)


def layer_expert_params(shape: ModelShape, tp: int, ep: int = 1) -> float:
    """Routed-expert parameters of one (mean) layer on one rank: every expert / (tp·ep); 0 for a dense model."""
    return expert_params(shape) / shape.layers / (tp * ep)


@lru_cache(maxsize=4096)
def stage_params(shape: ModelShape, tp: int, pp: int, ep: int = 1) -> tuple[float, float]:
    """(first stage, last stage) parameters per GPU: layers + vocab-parallel embedding / output head."""
    body = layer_params(shape, tp, ep) * shape.layers / pp
    emb = shape.vocab * shape.hidden / tp
    if pp == 1:
        return (body + emb * (1 if shape.tied_embeddings else 2) + shape.hidden,) * 2
    # pp > 1: the head is the last stage's own; a tied model's last stage holds a copy of the embedding for it
    # (weights, gradient and optimizer state; train/tied.py sums the two copies' gradients), so the sizes are equal
    return body + emb, body + emb + shape.hidden


#: the linears a LoRA target name stands for ("all-linear": every one of them, PEFT's spelling)
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_layer_params(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters of one layer: r·(in + out) per targeted linear (lora_A is r × in, lora_B out × r; Hu et
    al. 2021 §4). An MoE layer's experts are not targeted (their names differ)."""
    dims = _linear_dims(shape)
    names = dims if "all-linear" in targets else [t for t in targets if t in dims]
    return sum(rank * sum(dims[n]) for n in names)


def quantized_bytes_per_param(kind: str, double_quant: bool = True, in_features: int = 4096) -> float:
    """Bytes a quantized base weight takes, its constants included (Dettmers et al. 2023 §3): nf4/fp4 half a byte
    plus an fp32 absmax per block of 64 (0.0625 B), or with double quantization one byte per 64 and an fp32 per
    64 · 256 (0.0159 B); int8 one byte plus an fp32 scale per row."""
    if kind == "int8":
        return 1.0 + 4.0 / in_features
    return 0.5 + (1 / 64 + 4 / (64 * 256) if double_quant else 4 / 64)


def quantized_layer_params(shape: ModelShape) -> int:
    """Parameters of one layer's decoder linears (q, k, v, o and the MLP's): what train.lora.quantize stores
    quantized; norms, embedding and head stay in 16 bits."""
    return sum(a * b for a, b in _linear_dims(shape).values())


def _linear_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, f = shape.hidden, shape.ffn_hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "down_proj": (f, h)}
    return dims | ({"gate_proj": (h, f), "up_proj": (h, f)} if shape.gated_mlp else {"up_proj": (h, f)})


def _quantized_stage(
    shape: ModelShape, c: ParallelDims, params: float, layers: int, unit: float, qb: float, wb: float, keep: bool
) -> tuple[float, float]:
    """(bytes a quantized base saves on this rank, its working set): the linears at `quantized_bytes_per_param`;
    FSDP2 gathers the stored bytes (two layers, or under PP / ZeRO-2 the whole stage); bitsandbytes dequantizes
    one linear per matmul and frees it after, so the widest linear in the compute dtype is the working copy."""
    lin = quantized_layer_params(shape) / c.tp
    d = c.shard
    saved = layers * lin / d * (wb - qb)
    gathered = 0.0
    if d > 1:
        stored = (params - layers * lin) * wb + layers * lin * qb  # the stage as stored, whole
        gathered = stored if keep else 2 * ((unit - lin) * wb + lin * qb)
    widest = max(a * b for a, b in _linear_dims(shape).values()) / c.tp
    return saved, gathered + widest * wb


def _state_bytes(precision: str) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per parameter for AdamW."""
    # fp8 (torchao float8 linears): bf16 weights cast per matmul, so bf16's states
    return (4.0, 4.0, 8.0) if precision == "fp32" else (2.0, 2.0, 12.0)


def rank_layers(shape: ModelShape, c: ParallelDims) -> tuple[int, ...]:
    """Transformer layers each pipeline rank holds (its chunks summed: ParallelDims.chunk_rank places them)."""
    if c.stages is None:
        return (shape.layers // c.pp,) * c.pp
    return c.rank_sizes(shape.layers)


def rank_params(shape: ModelShape, c: ParallelDims) -> list[float]:
    """Parameters per GPU of every pipeline rank: its layers plus the embedding (first) or head (last)."""
    first_p, last_p = stage_params(shape, c.tp, c.pp, c.ep)
    if c.pp == 1:
        return [first_p]
    unit = layer_params(shape, c.tp, c.ep)
    even = unit * shape.layers / c.pp
    sizes = rank_layers(shape, c)
    out = [n * unit for n in sizes]
    out[0] += first_p - even
    out[c.head_rank] += last_p - even  # the head's rank (zbv: rank 0)
    return out


def memory_breakdown(
    shape: ModelShape,
    c: ParallelDims,
    seq: int,
    precision: str = "bf16",
    fused_attention: bool = True,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] = ("all-linear",),
    native_trainer: bool = True,
    lora_quantize: str | None = None,
    lora_double_quant: bool = True,
) -> MemoryBreakdown:
    """Predicted memory of the busiest pipeline rank: every rank's layers, embedding or head, and the
    micro-batches it holds in flight (planner/inflight.py), the largest total wins.
    `lora_rank` (train.lora): the base weights are frozen (weights only: no gradients, no optimizer state) and
    each layer's adapters (`lora_layer_params`, split over TP) carry weights, gradients and fp32 Adam state.
    `lora_quantize` (train.lora.quantize): the base's linears quantized, the widest dequantized (_quantized_stage)."""
    wb, gb, ob = _state_bytes(precision)
    unit = layer_params(shape, c.tp, c.ep)
    params_of = rank_params(shape, c)
    # context parallel: each rank holds seq/cp tokens of activations
    local = seq / c.cp
    # other trainers (what-ifs) save sequence-parallel linear inputs sharded, as Megatron does, and gathered K/V
    act = dict(fused_attention=fused_attention, cp=c.cp, other_trainer=not native_trainer)
    per_layer_act = activation_bytes_per_layer(shape, local, c.micro_batch, c.tp, c.sp, c.recompute, **act)
    # a layer being recomputed (full) or its attention core (selective) is briefly whole again in backward
    working = 0.0
    if c.recompute != "none":
        whole = activation_bytes_per_layer(shape, local, c.micro_batch, c.tp, c.sp, "none", **act)
        working = whole if c.recompute == "full" else whole - per_layer_act
    if precision == "fp32":  # the counts are of 16-bit activations; fp32 training saves every tensor at 4 bytes
        per_layer_act, working = 2 * per_layer_act, 2 * working
    # the layers in flight, the stage boundary and the logits of every pipeline rank (planner/stage_memory.py)
    rank_acts = rank_bytes(shape, c, seq, per_layer_act, precision, native_trainer, logit_bytes(shape, c, seq))
    working += offload_working_bytes(c, per_layer_act)  # a layer on its way to or from host memory
    working += _cp_working(shape, c, seq, wb, native_trainer)
    d = c.shard
    # nightloom's FSDP2 accumulates unsharded gradients until the last micro-batch (ACCUM_GRAD_BYTES): grads_gib;
    # not when it reduce-scatters every micro-batch (parallel.reduce_each_micro_batch)
    acc = ACCUM_GRAD_BYTES if native_trainer and d > 1 and c.grad_accum > 1 and not c.reduce_each_micro_batch else 0
    # ZeRO-3 without PP gathers 2 layers at a time; under PP, or ZeRO-2, the rank's whole stage stays gathered
    keep_gathered = c.pp > 1 or c.zero == "zero2"

    de = c.expert_shard
    ex_unit = layer_expert_params(shape, c.tp, c.ep) if shape.moe else 0.0

    def stage(params: float, acts: float, layers: int) -> tuple[float, ...]:
        gathered = 0.0
        if d > 1:  # FSDP working set: gathered bf16 params + 1 layer of grads
            gathered = (params if keep_gathered else 2 * unit) * wb + unit * gb
        # a rank's experts (already / ep) are sharded over the expert_shard ranks holding the same experts
        ex = layers * ex_unit
        held = (params - ex) / d + ex / de
        if lora_rank:  # frozen base: weights only; the adapters train
            adapters = layers * lora_layer_params(shape, lora_rank, lora_targets) / c.tp / d
            base = held * wb
            if lora_quantize:  # QLoRA: the linears quantized; the widest dequantized while it computes
                qb = quantized_bytes_per_param(lora_quantize, lora_double_quant, shape.hidden)
                saved, gathered = _quantized_stage(shape, c, params, layers, unit, qb, wb, keep_gathered)
                base -= saved
            return (base + adapters * wb, adapters * (gb + d * acc), adapters * ob, acts, gathered)
        return (held * wb, held * gb + params * acc, held * ob, acts, gathered)

    sizes = rank_layers(shape, c)
    best = None
    for i, n in enumerate(sizes):
        acts = rank_acts[i] + working
        parts = stage(params_of[i], acts, n)
        if best is None or sum(parts) > sum(best):
            best = parts
    w, g, o, a, gathered = best
    return MemoryBreakdown(
        weights_gib=w / GIB,
        grads_gib=g / GIB,
        optimizer_gib=o / GIB,
        activations_gib=a / GIB,
        overhead_gib=FRAMEWORK_OVERHEAD_GIB + gathered / GIB,
        host_gib=max(offload_host_bytes(shape, c, per_layer_act, chunk_input_bytes(shape, c, seq, precision))) / GIB,
    )


def _cp_working(shape: ModelShape, c: ParallelDims, seq: int, wb: float, native_trainer: bool) -> float:
    """All-gather CP: the whole sequence's K,V while a layer attends; in backward fp32 dK,dV (torch: the
    accumulators and the one arriving). nightloom's trainer gathers K/V repeated to every query head (as
    steptime.py counts the gather's bytes)."""
    if c.cp == 1:
        return 0.0
    heads = shape.heads if native_trainer else shape.kv_heads
    kv = 2 * c.micro_batch * heads * shape.head_dim / c.tp  # K and V elements per token
    return seq * kv * wb + 2 * seq / c.cp * kv * 4


def usable_gib(capacity_gib: float) -> float:
    """Memory a layout may plan to use: capacity less the fragmentation headroom."""
    return capacity_gib * (1 - HEADROOM_FRACTION)
