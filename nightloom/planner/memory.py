"""Memory per GPU on the busiest pipeline stage: states under the chosen sharding plus activations in flight.

States (ZeRO, Rajbhandari et al. 2020 §3.1): mixed-precision Adam holds 2 (bf16 weights) + 2 (grads) + 12 (fp32 master, m, v)
bytes per parameter, fp32 training 4 + 4 + 8; ZeRO-3/FSDP divides all of them by the shard degree and adds the
gathered working set (with pipeline parallelism FSDP2 must keep the stage gathered, reshard_after_forward=False).

Activations per layer and micro-batch: Korthikanti et al. 2022, Table 2 (s seq, b micro-batch, h hidden,
a heads, t TP), in bytes:
    no recompute          t=1: s·b·h·(34 + 5·a·s/h)   TP: s·b·h·(10 + 24/t + 5·a·s/(h·t))   TP+SP: s·b·h·(34 + 5·a·s/h)/t
    selective recompute   TP+SP: 34·s·b·h/t            (TP without SP: s·b·h·(10 + 24/t))
    full recompute        2·s·b·h (the layer input; /t when SP shards it)
Qwen3's per-head q/k RMSNorms (`shape.qk_norm`) save their inputs as the layer norms of Table 2 do (its 4·s·b·h
for two norms): q and k before RoPE, 2·s·b·(q_dim + kv_dim) bytes in bf16 (q_dim = a·head_dim, kv_dim =
kv_heads·head_dim). They are outputs of the column-parallel QKV projection, so TP shards them over heads (/t with
or without SP, as Table 2's 24/t terms), and they are kept under selective recompute (it recomputes only the
attention core after them); full recompute keeps only the layer input.
Gemma 3's post-norms (`shape.post_norms`: an RMSNorm on the attention output and one on the MLP output, before
each residual add) save their inputs too, as Table 2's two layer norms do: 2 more 16-bit s·b·h tensors, 4·s·b·h
bytes per layer. They sit where Table 2's norms sit (after the row-parallel o/down projection's all-reduce, or its
reduce-scatter under SP), so they are replicated under TP and /t under SP, and kept under selective recompute.
Table 2 assumes materialised attention scores (PTD-P's fused softmax kernels: `fused_attention=False`, kept for
the PTD-P reference rows and what-ifs). The default is what the trainer runs: SDPA, which on a GPU is a fused
(flash or memory-efficient) kernel, so the 5·a·s/h score terms vanish: only Q, K, V and the output are kept
(plus a row statistic per head), and selective recompute has nothing left to save (Dao 2023, FlashAttention-2
§3.1). Sliding-window layers pass one boolean mask shared by every layer (train/model.py): t² bytes, not counted.
1F1B keeps up to pp micro-batches on stage 0 (interleaved: × (1 + (p−1)/(p·v)), Narayanan et al. 2021 §2.2.2);
GPipe keeps all of them. The last stage adds the logits (fp32, vocab sharded by TP with loss parallel), or
where the trainer fuses the loss with the head (pp = tp = cp = 1, `chunked_ce`) a few fp32 chunks of them.
"""

from __future__ import annotations

from functools import lru_cache

from nightloom.parallel import MemoryBreakdown, ParallelDims
from nightloom.perf import attention_params, expert_params, mlp_params
from nightloom.shape import ModelShape

GIB = 1024**3
#: CUDA context, NCCL/HCCL buffers, cuBLAS workspaces: a fixed cost per GPU.
FRAMEWORK_OVERHEAD_GIB = 1.5
#: Fraction of device memory kept free for allocator fragmentation and transient peaks.
HEADROOM_FRACTION = 0.08
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


def activation_bytes_per_layer(
    shape: ModelShape, seq: int, mb: int, tp: int, sp: bool, recompute: str, fused_attention: bool = True
) -> float:
    """Saved activations of one layer for one micro-batch (Korthikanti et al. 2022, Table 2), plus the q/k norms'
    and Gemma's post-norms' saved inputs where the shape has them (`qk_norm_bytes`, `post_norm_bytes`); a fused
    attention kernel stores no scores (the 5·a·s/h term is 0)."""
    s, b, h, a, t = seq, mb, shape.hidden, shape.heads, tp
    sbh = s * b * h
    attn = 0.0 if fused_attention else 5 * a * s / h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    norms = qk_norm_bytes(shape, seq, mb, tp) + post_norm_bytes(shape, seq, mb, tp, sp)
    norms += moe_activation_bytes(shape, seq, mb, tp, recompute)
    if recompute == "selective":
        return (34 * sbh / t if sp else sbh * (10 + 24 / t)) + norms
    if t == 1:
        return sbh * (34 + attn) + norms
    if sp:
        return sbh * (34 + attn) / t + norms
    return sbh * (10 + 24 / t + attn / t) + norms


def moe_activation_bytes(shape: ModelShape, seq: int, mb: int, tp: int, recompute: str) -> float:
    """What an MoE layer saves beyond Table 2's MLP (mean over layers): Table 2 counts an MLP of 4h as 2·sbh input +
    16·sbh for its 4h-wide outputs + sbh; a routed layer keeps, for each of a token's k + shared experts, its
    dispatched input (2·h bytes) and the expert's outputs (4·f_e bytes: 2 tensors of f_e in bf16), plus the router's
    fp32 logits (4·E). Sharded over TP as the MLP's terms; nothing under full recompute (the layer input only)."""
    if not shape.moe or recompute == "full":
        return 0.0
    n = shape.experts_per_token + shape.shared_experts
    per_token = n * (2 * shape.hidden + 4 * shape.expert_ffn_hidden) + 4 * shape.num_experts - 16 * shape.hidden
    return seq * mb * per_token / tp * shape.moe_layers / shape.layers


def qk_norm_bytes(shape: ModelShape, seq: int, mb: int, tp: int) -> float:
    """Saved inputs of a layer's per-head q and k RMSNorms (bf16, sharded over heads by TP; 0 without them)."""
    if not shape.qk_norm:
        return 0.0
    return 2 * seq * mb * (shape.heads + shape.kv_heads) * shape.head_dim / tp


def post_norm_bytes(shape: ModelShape, seq: int, mb: int, tp: int, sp: bool) -> float:
    """Saved inputs of a layer's post-attention and post-feedforward norms (Gemma 3): 2 · 2·s·b·h bytes in bf16,
    as Table 2 counts its two layer norms (4·s·b·h), /t under SP, replicated under TP alone; 0 without them."""
    if not shape.post_norms:
        return 0.0
    return 2 * 2 * seq * mb * shape.hidden / (tp if sp else 1)


#: the linears a LoRA target name stands for ("all-linear": every one of them, PEFT's spelling)
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_layer_params(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters of one layer: r·(in + out) per targeted linear (lora_A is r × in, lora_B out × r; Hu et
    al. 2021 §4). An MoE layer's experts are not targeted (their names differ)."""
    h, f = shape.hidden, shape.ffn_hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "down_proj": (f, h)}
    dims |= {"gate_proj": (h, f), "up_proj": (h, f)} if shape.gated_mlp else {"up_proj": (h, f)}
    names = dims if "all-linear" in targets else [t for t in targets if t in dims]
    return sum(rank * sum(dims[n]) for n in names)


def _state_bytes(precision: str) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per parameter for AdamW."""
    # fp8 (torchao float8 linears): bf16 weights cast per matmul, so bf16's states
    return (4.0, 4.0, 8.0) if precision == "fp32" else (2.0, 2.0, 12.0)


def rank_layers(shape: ModelShape, c: ParallelDims) -> tuple[int, ...]:
    """Transformer layers each pipeline rank holds (its chunks summed: chunk k lives on rank k mod pp)."""
    if c.stages is None:
        return (shape.layers // c.pp,) * c.pp
    return _per_rank(c.stages, c.pp)


@lru_cache(maxsize=4096)
def _per_rank(stages: tuple[int, ...], pp: int) -> tuple[int, ...]:
    return tuple(sum(stages[r::pp]) for r in range(pp))


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
    out[-1] += last_p - even
    return out


def memory_breakdown(
    shape: ModelShape,
    c: ParallelDims,
    seq: int,
    precision: str = "bf16",
    fused_attention: bool = True,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] = ("all-linear",),
) -> MemoryBreakdown:
    """Predicted memory of the busiest pipeline rank: every rank's layers, embedding or head, and the
    micro-batches it holds in flight (1F1B: rank i holds min(pp − i, m)), the largest total wins.
    `lora_rank` (train.lora): the base weights are frozen (weights only: no gradients, no optimizer state) and
    each layer's adapters (`lora_layer_params`, split over TP) carry weights, gradients and fp32 Adam state."""
    wb, gb, ob = _state_bytes(precision)
    unit = layer_params(shape, c.tp, c.ep)
    params_of = rank_params(shape, c)
    # context parallel: each rank holds seq/cp tokens, and ring attention's blockwise scores are (seq/cp)² per step
    local = seq / c.cp
    per_layer_act = activation_bytes_per_layer(shape, local, c.micro_batch, c.tp, c.sp, c.recompute, fused_attention)
    m = c.grad_accum
    interleave = 1 + (c.pp - 1) / (c.pp * c.virtual_stages) if c.virtual_stages > 1 else 1.0
    # a layer being recomputed (full) or its attention core (selective) is briefly whole again in backward
    working = 0.0
    if c.recompute != "none":
        whole = activation_bytes_per_layer(shape, local, c.micro_batch, c.tp, c.sp, "none", fused_attention)
        working = whole if c.recompute == "full" else whole - per_layer_act
    logits = logit_bytes(shape, c, seq)
    if c.cp > 1:  # ring attention: the K,V block in use and the one arriving, and in backward their gradients
        working += 4 * 2 * seq / c.cp * c.micro_batch * shape.kv_heads * shape.head_dim / c.tp * wb
    d = c.shard
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
            return (held * wb + adapters * wb, adapters * gb, adapters * ob, acts, gathered)
        return (held * wb, held * gb, held * ob, acts, gathered)

    sizes = rank_layers(shape, c)
    last = c.pp - 1
    best, seen = None, set()
    for i, n in enumerate(sizes):
        if 0 < i < last and n in seen:  # a later middle rank of the same size holds fewer micro-batches
            continue
        seen.add(n)
        if i == last:
            acts = n * per_layer_act + working + logits
        else:
            acts = n * per_layer_act * min(c.pp - i, m) * interleave + working
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
    )


def usable_gib(capacity_gib: float) -> float:
    """Memory a layout may plan to use: capacity less the fragmentation headroom."""
    return capacity_gib * (1 - HEADROOM_FRACTION)
