"""Memory per GPU on the busiest pipeline stage: states under the chosen sharding plus activations in flight.

States (DESIGN.md "Memory"): mixed-precision Adam holds 2 (bf16 weights) + 2 (grads) + 12 (fp32 master, m, v)
bytes per parameter, fp32 training 4 + 4 + 8; ZeRO-3/FSDP divides all of them by the shard degree and adds the
gathered working set (with pipeline parallelism FSDP2 must keep the stage gathered, reshard_after_forward=False).

Activations per layer and micro-batch: Korthikanti et al. 2022, Table 2 (s seq, b micro-batch, h hidden,
a heads, t TP), in bytes:
    no recompute          t=1: s·b·h·(34 + 5·a·s/h)   TP: s·b·h·(10 + 24/t + 5·a·s/(h·t))   TP+SP: s·b·h·(34 + 5·a·s/h)/t
    selective recompute   TP+SP: 34·s·b·h/t            (TP without SP: s·b·h·(10 + 24/t))
    full recompute        2·s·b·h (the layer input; /t when SP shards it)
These assume materialised attention scores (no flash attention): conservative for modern kernels.
1F1B keeps up to pp micro-batches on stage 0 (interleaved: × (1 + (p−1)/(p·v)), Narayanan et al. 2021 §2.2.2);
GPipe keeps all of them. The last stage adds the logits (fp32, vocab sharded by TP with loss parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

from nightloom.catalog import ModelShape
from nightloom.parallel import MemoryBreakdown

GIB = 1024**3
#: CUDA context, NCCL/HCCL buffers, cuBLAS workspaces: a fixed cost per GPU.
FRAMEWORK_OVERHEAD_GIB = 1.5
#: Fraction of device memory kept free for allocator fragmentation and transient peaks.
HEADROOM_FRACTION = 0.08
#: Bytes per element of the saved fp32 logits (upcast for the cross-entropy) on the last stage.
LOGIT_BYTES = 4


@dataclass(frozen=True, slots=True)
class Candidate:
    """One fully specified layout the search evaluates (cheap to build; turned into a ParallelPlan at the end)."""

    tp: int
    pp: int
    dp_replicate: int
    dp_shard: int
    sp: bool
    micro_batch: int
    virtual_stages: int
    recompute: str
    grad_accum: int
    zero: str = (
        "none"  # "none": dp_shard ranks hold replicas (plain DP); "fsdp": they shard (ZeRO-3), HSDP if dp_replicate > 1
    )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Degree the weights, grads and optimizer states are divided by."""
        return self.dp_shard if self.zero == "fsdp" else 1

    @property
    def schedule(self) -> str:
        return "interleaved_1f1b" if self.virtual_stages > 1 else "1f1b"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def layer_params(shape: ModelShape, tp: int) -> float:
    """Parameters of one transformer layer held by one TP rank (matrices split, norms replicated)."""
    h, kv_dim = shape.hidden, shape.kv_heads * shape.head_dim
    mats = 2 * h * h + 2 * h * kv_dim + (3 if shape.gated_mlp else 2) * h * shape.ffn_hidden
    return mats / tp + 2 * h


def stage_params(shape: ModelShape, tp: int, pp: int) -> tuple[float, float]:
    """(first stage, last stage) parameters per GPU: layers + vocab-parallel embedding / output head."""
    body = layer_params(shape, tp) * shape.layers / pp
    emb = shape.vocab * shape.hidden / tp
    if pp == 1:
        return (body + emb * (1 if shape.tied_embeddings else 2) + shape.hidden,) * 2
    # with tied embeddings and pp > 1 the last stage keeps its own copy of the embedding for the head
    return body + emb, body + emb + shape.hidden


def activation_bytes_per_layer(shape: ModelShape, seq: int, mb: int, tp: int, sp: bool, recompute: str) -> float:
    """Saved activations of one layer for one micro-batch (Korthikanti et al. 2022, Table 2)."""
    s, b, h, a, t = seq, mb, shape.hidden, shape.heads, tp
    sbh = s * b * h
    attn = 5 * a * s / h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if recompute == "selective":
        return 34 * sbh / t if sp else sbh * (10 + 24 / t)
    if t == 1:
        return sbh * (34 + attn)
    if sp:
        return sbh * (34 + attn) / t
    return sbh * (10 + 24 / t + attn / t)


def _state_bytes(precision: str) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per parameter for AdamW."""
    return (2.0, 2.0, 12.0) if precision == "bf16" else (4.0, 4.0, 8.0)


def memory_breakdown(shape: ModelShape, c: Candidate, seq: int, precision: str = "bf16") -> MemoryBreakdown:
    """Predicted memory of the busiest pipeline stage (max of first and last stage)."""
    wb, gb, ob = _state_bytes(precision)
    first_p, last_p = stage_params(shape, c.tp, c.pp)
    per_layer_act = activation_bytes_per_layer(shape, seq, c.micro_batch, c.tp, c.sp, c.recompute)
    layers_per_stage = shape.layers // c.pp
    m = c.grad_accum
    if c.pp == 1:
        in_flight = 1.0
    else:
        in_flight = float(min(c.pp, m))
        if c.virtual_stages > 1:
            in_flight *= 1 + (c.pp - 1) / (c.pp * c.virtual_stages)
    # a layer being recomputed (full) or its attention core (selective) is briefly whole again in backward
    working = 0.0
    if c.recompute != "none":
        whole = activation_bytes_per_layer(shape, seq, c.micro_batch, c.tp, c.sp, "none")
        working = whole if c.recompute == "full" else whole - per_layer_act
    logits = LOGIT_BYTES * seq * c.micro_batch * shape.vocab / c.tp

    def stage(params: float, acts: float) -> MemoryBreakdown:
        d = c.shard
        gathered = 0.0
        if d > 1:  # FSDP working set: gathered bf16 params (whole stage under PP, else 2 layers) + 1 layer of grads
            unit = layer_params(shape, c.tp)
            gathered = (params if c.pp > 1 else 2 * unit) * wb + unit * gb
        return MemoryBreakdown(
            weights_gib=params * wb / d / GIB,
            grads_gib=params * gb / d / GIB,
            optimizer_gib=params * ob / d / GIB,
            activations_gib=acts / GIB,
            overhead_gib=FRAMEWORK_OVERHEAD_GIB + gathered / GIB,
        )

    first = stage(first_p, layers_per_stage * per_layer_act * in_flight + working)
    last = stage(last_p, layers_per_stage * per_layer_act + working + logits)
    return first if first.total_gib >= last.total_gib else last


def usable_gib(capacity_gib: float) -> float:
    """Memory a layout may plan to use: capacity less the fragmentation headroom."""
    return capacity_gib * (1 - HEADROOM_FRACTION)
