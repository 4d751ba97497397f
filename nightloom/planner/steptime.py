"""Step time of a layout: compute at one efficiency factor, memory-bound kernels, collectives, the bubble.

Per micro-batch and pipeline stage (per GPU):
  matmul    = FLOPs / (efficiency · peak); FLOPs from nightloom.perf (hardware=True: recompute counted),
              the output head's 6·V·h on the last stage.
  hbm       = bytes of the element-wise kernels / HBM bandwidth: norms and residual/dropout adds (11·h elements
              per token, replicated across TP unless SP shards them), the MLP activation (2 or 3 × ffn / t) and the
              materialised softmax + dropout over a·s scores per token (4 passes, / t); forward once, backward
              twice, recomputed forward once more (selective: the softmax part only); 2 bytes per element.
  tp        = Megatron TP collectives, 2 per layer forward and 2 backward (+2 for a full recompute), each moving
              s·b·h·2 bytes at nccl-tests bus bandwidth (all-reduce algbw·2(n−1)/n; SP's all-gather +
              reduce-scatter pair moves the same), not overlapped.
  p2p       = pipeline send/recv of the stage boundary activation forward and its gradient backward (× v),
              split over the t TP ranks' links (SP, or Megatron's scatter/gather, Narayanan et al. 2021 §4.1).
With a fused (flash-style) attention kernel (`fused_attention=True`, the default: what current stacks and
nightloom's own SDPA on a GPU run; False models PTD-P's materialised scores) the scores never reach HBM (no softmax term), and the attention core's matmuls are those the kernel
does: causal blocks above the diagonal skipped (half of QKᵀ and AV), the backward's 5 matmuls recomputing QKᵀ
(FlashAttention-2, Dao 2023, §3.1): 7·s·(a·d) FLOPs per token and layer in place of the formula's 12·s·(a·d).
The pipeline runs m slots of its slowest rank plus (p − 1)/v average slots (bubble (p−1)/(v·m), Narayanan et
al. 2021; zbv: `zbv_bubble`); with uneven stages each rank's slot counts its own layers, the last adds the output head.
Data parallel: gradient all-reduce (replicated) or reduce-scatter + all-gather (FSDP/ZeRO-3 gathers in forward
and backward, ZeRO-2 in forward only; HSDP adds an all-reduce over replicas) overlapped with backward compute; only the excess is exposed. FSDP's gradients are reduce-scattered once after the last micro-batch, or
after each (`reduce_each_micro_batch`: one more reduce-scatter per micro-batch, overlapped). Under sequence
parallel nightloom's linears gather their input again in backward (train/sp_shard.py): 2 all-gathers more per
layer, not overlapped (Megatron overlaps them with the input-gradient matmul). The optimizer step is HBM-bound.
Context parallel: each rank computes seq/cp tokens; K,V are all-gathered over the cp group per layer (forward,
again in backward, again for a full recompute), partly hidden behind the attention core (`cp_exposed_s`).
Activation offload (parallel.offload_layers): the copies to host and back, beyond the slot they overlap
(planner/offload.py).
Expert parallel (MoE): per MoE layer the token dispatch and combine all-to-alls, 2 forward and 2 backward (+2 for a
full recompute), each rank sending its s·b/t tokens × k experts × h × 2 bytes, (n−1)/n of it to other ranks
(nccl-tests' alltoall bus bandwidth, algbw·(n−1)/n): the share to peers in its node over NVLink, the rest over its
own NIC, the slower of the two; not overlapped (Megatron-Core's default dispatcher). The expert matmuls are in
the FLOPs already (activated parameters, perf.py).
A group's bus bandwidth is the intra-node link when it stays in a node, else min(intra, k · NIC) with k of its
members per node each using their own NIC (rail-optimised clusters, as the catalog assumes).
"""

from __future__ import annotations

from dataclasses import dataclass

from nightloom.catalog import GPUSpec
from nightloom.parallel import MESH_ORDER, ParallelDims
from nightloom.perf import flops_per_token
from nightloom.planner.activations import activation_bytes_per_layer
from nightloom.planner.memory import rank_layers, rank_params
from nightloom.planner.offload import exposed_s as offload_exposed_s
from nightloom.shape import ModelShape

#: The one compute efficiency factor: achieved/peak dense matmul FLOP/s in a tuned training stack. Fitted once
#: (mean error zero) on the first four rows of datasets/reference/published_runs.csv (PTD-P 1.7B–18.4B); the
#: larger rows were not used to set it. Everything else in the model is counted physics; no per-model or
#: per-row constants. Ledger calibration moves it within CALIBRATION_BOUNDS.
DEFAULT_EFFICIENCY = 0.58
CALIBRATION_BOUNDS = (0.5, 1.5)
MAX_EFFICIENCY = 0.95
#: bytes moved per parameter by AdamW's update: read fp32 master, m, v, grad; write master, m, v, bf16 weight
OPTIMIZER_BYTES_PER_PARAM = 34


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """Predicted seconds per optimizer step and its parts (per GPU, busiest stage)."""

    step_s: float
    matmul_s: float
    hbm_s: float
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    dp_exposed_s: float
    optimizer_s: float
    cp_comm_s: float = 0.0
    slot_max_s: float = 0.0  # one micro-batch on the slowest pipeline rank
    slot_avg_s: float = 0.0
    ep_comm_s: float = 0.0  # expert-parallel all-to-all, exposed
    offload_s: float = 0.0  # activation copies to and from host memory beyond the compute they overlap


def calibrated_efficiency(calibration: float | None, base: float = DEFAULT_EFFICIENCY) -> float:
    """The efficiency factor scaled by the ledger's measured/predicted MFU ratio, bounded."""
    if calibration is None:
        return base
    lo, hi = CALIBRATION_BOUNDS
    return min(MAX_EFFICIENCY, base * min(hi, max(lo, calibration)))


def group_bandwidth(dim: str, c: ParallelDims, gpus_per_node: int, gpu: GPUSpec) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of the process group along mesh dim `dim` (MESH_ORDER placement)."""
    sizes = {"pp": c.pp, "dp_replicate": c.dp_replicate, "dp_shard": c.dp_shard, "cp": c.cp, "tp": c.tp}
    stride = 1
    for name in reversed(MESH_ORDER):
        if name == dim:
            break
        stride *= sizes[name]
    n = sizes[dim]
    span = stride * n
    if span <= gpus_per_node and gpus_per_node % span == 0:
        return gpu.intra_node_bw, gpu.intra_node_latency_s
    per_node = min(n, gpus_per_node // stride) if stride < gpus_per_node else 1
    return min(gpu.intra_node_bw, per_node * gpu.inter_node_bw), gpu.inter_node_latency_s


def all_to_all_s(c: ParallelDims, nbytes: float, gpus_per_node: int, gpu: GPUSpec) -> float:
    """One all-to-all of `nbytes` per rank over the ep group (its ranks adjacent outside tp, as torchtitan and
    Megatron draw them from the data-parallel ranks): (local − 1)/ep of the bytes over NVLink, (ep − local)/ep
    over the rank's NIC, the slower of the two, plus one latency."""
    n = c.ep
    if n <= 1:
        return 0.0
    local = max(1, min(n, gpus_per_node // c.tp)) if c.tp <= gpus_per_node else 1
    intra = (local - 1) / n * nbytes / gpu.intra_node_bw
    inter = (n - local) / n * nbytes / gpu.inter_node_bw
    lat = gpu.inter_node_latency_s if local < n else gpu.intra_node_latency_s
    return max(intra, inter) + lat


def bubble_fraction(pp: int, virtual_stages: int, microbatches: int) -> float:
    """Pipeline bubble over useful time: (p − 1)/(v·m) (Narayanan et al. 2021 §2.2); the one copy of it."""
    return (pp - 1) / (virtual_stages * microbatches)


def zbv_bubble(pp: int, core_share: float) -> float:
    """The V-shaped zero-bubble schedule's idle time in slots (Qi et al. 2024 §6: (p − 1)·(T_F + T_B − 2·T_W) per
    chunk, T_B the input pass). With a linear's forward, input and weight passes alike and the attention core's
    backward all input pass (FlashAttention-2's 2 + 5 of its 7·s·(a·d)), T_F + T_B − 2·T_W is the core's 7, and a
    slot (both chunks' F, B and W) 2·(3·linear + 7·core): (p − 1)·core_share/2 slots, `core_share` the core's part of
    a layer's FLOPs."""
    return (pp - 1) * core_share / 2


def ring_s(n: int, nbytes: float, bw: float, lat: float, factor: float) -> float:
    """Ring collective time: factor·(n−1)/n·bytes/busbw + latency per hop (factor 2 all-reduce, 1 AG/RS)."""
    if n <= 1:
        return 0.0
    return factor * (n - 1) / n * nbytes / bw + factor * (n - 1) * lat


def cp_exposed_s(
    cp: int, block: float, ebytes: int, bw: float, lat: float, fwd: float, bwd: float, recompute: bool, native: bool
) -> float:
    """Seconds of one layer's context-parallel communication not hidden behind its attention (one micro-batch).

    `block`: this rank's K and V bytes; `fwd`/`bwd`: the attention core's seconds on this rank, of which each of
    the cp steps computes 1/cp (load-balanced causal chunks). nightloom's trainer (torch's context_parallel, its
    default `_RotateMethod.ALL_GATHER`): forward all-gathers K,V once, started before the local diagonal step
    and waited on after it; backward gathers K,V again the same way and passes the fp32 dK,dV accumulators to the
    ring neighbour cp − 1 times, each hop behind one step. Other trainers as Llama 3's (Grattafiori et al. 2024
    §3.3.2): K,V all-gathered before the attention, "exposed in the critical path", and dK,dV reduce-scattered
    back; K,V are kept for backward. A full recompute repeats the forward's gather."""
    gather = ring_s(cp, cp * block, bw, lat, 1.0)  # each rank receives cp − 1 blocks
    if native:
        hop = block * 4 / ebytes / bw + lat
        fwd_s = max(0.0, gather - fwd / cp)
        bwd_s = max(0.0, gather - bwd / cp) + (cp - 1) * max(0.0, hop - bwd / cp)
    else:
        fwd_s, bwd_s = gather, gather
    return fwd_s * (2 if recompute else 1) + bwd_s


def _pp_s(c: ParallelDims, tokens: float, h: int, ebytes: int, gpus_per_node: int, gpu: GPUSpec) -> float:
    """Pipeline point-to-point seconds per micro-batch: activations sent forward and gradients back per stage."""
    t = c.tp
    pp_s = 0.0
    if c.pp > 1:
        pp_bw, pp_lat = group_bandwidth("pp", c, gpus_per_node, gpu)
        if pp_bw != gpu.intra_node_bw:  # a send between nodes goes through this GPU's own NIC
            pp_bw = gpu.inter_node_bw
        msg = tokens * h * ebytes / t  # SP shards it; without SP, Megatron's scatter/gather does (PTD-P §4.1)
        pp_s = 2 * c.virtual_stages * (msg / pp_bw + pp_lat)
    return pp_s


def _cp_s(
    shape: ModelShape,
    c: ParallelDims,
    seq: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    peak: float,
    ebytes: int,
    tokens: float,
    lps: float,
    fused_attention: bool,
    native_trainer: bool,
) -> float:
    """Context parallel (all-gather attention, see cp_exposed_s): K,V gathered over the cp group per layer."""
    t = c.tp
    cp_s = 0.0
    if c.cp > 1:
        cp_bw, cp_lat = group_bandwidth("cp", c, gpus_per_node, gpu)
        if cp_bw != gpu.intra_node_bw:
            cp_bw = gpu.inter_node_bw
        # this rank's K and V; nightloom's trainer repeats grouped K/V heads to every query head under CP
        # (Transformer.expand_kv_heads), an all-gather trainer as Llama 3's sends them grouped
        heads = shape.heads if native_trainer else shape.kv_heads
        block = tokens * 2 * heads * shape.head_dim / t * ebytes
        core = tokens * shape.heads * shape.head_dim * seq / t / peak  # one core-unit of attention seconds
        fwd, bwd = (2 * core, 5 * core) if fused_attention else (4 * core, 8 * core)
        cp_s = lps * cp_exposed_s(c.cp, block, ebytes, cp_bw, cp_lat, fwd, bwd, c.recompute == "full", native_trainer)
    return cp_s


def _ep_s(
    shape: ModelShape, c: ParallelDims, gpu: GPUSpec, gpus_per_node: int, ebytes: int, tokens: float, lps: float
) -> float:
    """Expert parallel: dispatch + combine all-to-alls of every MoE layer (mean over layers)."""
    L, h, t = shape.layers, shape.hidden, c.tp
    ep_s = 0.0
    if shape.moe and c.ep > 1:
        n_a2a = 4 + (2 if c.recompute == "full" else 0)
        payload = tokens / t * shape.experts_per_token * h * ebytes
        ep_s = lps * shape.moe_layers / L * n_a2a * all_to_all_s(c, payload, gpus_per_node, gpu)
    return ep_s


def _dp_exposed_s(
    c: ParallelDims, gpu: GPUSpec, gpus_per_node: int, gbytes: float, m: int, slot_max: float, lps: float
) -> float:
    """Data-parallel gradient sync (and FSDP's gathers) not hidden behind the backward compute."""
    bwd_frac = 0.75 if c.recompute == "full" else 2 / 3
    dp_exposed = 0.0
    if c.dp_shard > 1:  # ZeRO-3/FSDP or ZeRO-2
        sh_bw, sh_lat = group_bandwidth("dp_shard", c, gpus_per_node, gpu)
        ag = ring_s(c.shard, gbytes, sh_bw, sh_lat, 1.0)  # the trainer shards over dp_shard × cp
        # pp > 1: the stage stays gathered (one gather per step); ZeRO-2 gathers in forward only, ZeRO-3 in
        # forward and again in backward
        gathers_per_mb = 0 if c.pp > 1 else (1 if c.zero == "zero2" else 2)
        # gradients: reduce-scattered after the last micro-batch only (FSDP2's no-sync accumulation: under PP
        # torch's schedule reduces the stage once at the end, exposed; without PP the last backward hides all but
        # a layer's), or after every micro-batch (reduce_each_micro_batch: overlapped with each backward)
        each = c.reduce_each_micro_batch or m == 1
        per_mb = ag * gathers_per_mb + (ag if each else 0.0)
        tail = ag / max(lps, 1) if each or c.pp == 1 else ag
        dp_exposed = m * max(0.0, per_mb - slot_max) + tail
        if c.dp_replicate > 1:
            r_bw, r_lat = group_bandwidth("dp_replicate", c, gpus_per_node, gpu)
            ar = ring_s(c.dp_replicate, gbytes / c.shard, r_bw, r_lat, 2.0)
            dp_exposed += max(0.0, ar - bwd_frac * slot_max)
    else:  # replicas: one gradient all-reduce per step over every data-parallel rank
        r_bw, r_lat = group_bandwidth("dp_replicate", c, gpus_per_node, gpu)
        ar = ring_s(c.dp * c.cp, gbytes, r_bw, r_lat, 2.0)  # cp ranks hold the same parameters
        dp_exposed = max(0.0, ar - bwd_frac * slot_max)
    return dp_exposed


def _offload_s(
    shape: ModelShape, c: ParallelDims, seq: int, gpu: GPUSpec, ebytes: int, fused: bool, native: bool, slot: float
) -> float:
    """parallel.offload_layers: the copies out and back beyond each slot they overlap (planner/offload.py)."""
    if not c.offload_layers:
        return 0.0
    act = activation_bytes_per_layer(shape, seq / c.cp, c.micro_batch, c.tp, c.sp, c.recompute, fused, c.cp, not native)
    return offload_exposed_s(c, shape.layers, act * ebytes / 2, gpu.host_bw, slot)


def step_time(
    shape: ModelShape,
    c: ParallelDims,
    seq: int,
    gpu: GPUSpec,
    gpus_per_node: int,
    efficiency: float,
    precision: str = "bf16",
    fused_attention: bool = True,
    native_trainer: bool = True,
) -> StepEstimate:
    """Seconds per optimizer step of candidate `c` (see the module docstring for every term)."""
    peak = gpu.peak(precision) * efficiency
    ebytes = 4 if precision == "fp32" else 2  # fp8 (torchao) keeps bf16 activations and all-gathers
    L, h, t = shape.layers, shape.hidden, c.tp
    lps = L / c.pp  # layers per rank on average (uneven stages: see the slots below)
    tokens = seq * c.micro_batch / c.cp  # context parallel: each rank computes seq/cp of every sequence
    # compute: per-layer HFU FLOPs per token (recompute included) and the head's on the last stage
    layer_flops = flops_per_token(shape, seq, c.recompute, hardware=True) / L
    core = shape.heads * shape.head_dim * seq  # attention core FLOPs per token and layer = 12·core (PaLM)
    if fused_attention:  # the kernel's own count: 7·core (+2·core when a recompute replays the forward)
        counted = 12 * core * (4 / 3 if c.recompute != "none" else 1)
        layer_flops += 7 * core + (2 * core if c.recompute != "none" else 0) - counted
    head_flops = flops_per_token(shape, seq, lm_head=True) - flops_per_token(shape, seq)
    body_mm = tokens * layer_flops * lps / t / peak
    head_mm = tokens * head_flops / t / peak
    # memory-bound element-wise kernels
    passes = 4 if c.recompute == "full" else 3
    rep = 11 * h / (t if c.sp else 1)
    mlp = (3 if shape.gated_mlp else 2) * shape.ffn_hidden / t
    soft = 0.0 if fused_attention else 4 * shape.heads * seq / t
    elems = passes * (rep + mlp) + (passes + (1 if c.recompute == "selective" else 0)) * soft
    hbm_bw = gpu.hbm_bw or 2e12
    body_hbm = tokens * lps * elems * ebytes / hbm_bw
    head_hbm = tokens * shape.vocab / t * 4 * 3 / hbm_bw  # fp32 logits: write, softmax read/write, grad
    # tensor-parallel collectives
    tp_bw, tp_lat = group_bandwidth("tp", c, gpus_per_node, gpu)
    n_coll = 4 + (2 if c.recompute == "full" else 0)
    tp_s = lps * n_coll * ring_s(t, tokens * h * ebytes, tp_bw, tp_lat, 2.0)
    if c.sp and c.recompute != "full" and native_trainer:  # the attention's and MLP's inputs gathered again
        tp_s += lps * 2 * ring_s(t, tokens * h * ebytes, tp_bw, tp_lat, 1.0)
    # pipeline point-to-point
    pp_s = _pp_s(c, tokens, h, ebytes, gpus_per_node, gpu)
    # context parallel (all-gather attention, see cp_exposed_s): K,V gathered over the cp group per layer
    cp_s = _cp_s(shape, c, seq, gpu, gpus_per_node, peak, ebytes, tokens, lps, fused_attention, native_trainer)
    # expert parallel: dispatch + combine all-to-alls of every MoE layer (mean over layers)
    ep_s = _ep_s(shape, c, gpu, gpus_per_node, ebytes, tokens, lps)
    # every pipeline rank's slot (uneven stages: its own layer count); the last adds the output head
    per_layer = (body_mm + body_hbm + tp_s + cp_s + ep_s) / lps
    sizes = rank_layers(shape, c)
    slots = [n * per_layer + pp_s for n in sizes]
    slots[c.head_rank] += head_mm + head_hbm  # the head's rank (zbv: rank 0)
    m = c.grad_accum
    slot_max = max(slots)
    slot_avg = sum(slots) / c.pp
    bubble = bubble_fraction(c.pp, c.virtual_stages, m) * m * slot_avg
    if c.schedule == "zbv":  # weight passes fill the bubble but for the attention core's share (zbv_bubble)
        bubble = zbv_bubble(c.pp, (7 if fused_attention else 12) * core / layer_flops) * slot_avg
    pipe = m * slot_max + bubble
    # data parallel gradient sync, overlapped with backward compute
    p_stage = max(rank_params(shape, c))
    dp_exposed = _dp_exposed_s(c, gpu, gpus_per_node, p_stage * ebytes, m, slot_max, lps)
    opt = p_stage / c.shard * OPTIMIZER_BYTES_PER_PARAM / hbm_bw
    offload = _offload_s(shape, c, seq, gpu, ebytes, fused_attention, native_trainer, slot_max - pp_s)
    step = pipe + dp_exposed + opt + offload
    return StepEstimate(
        step,
        m * (body_mm + head_mm / c.pp),
        m * (body_hbm + head_hbm / c.pp),
        m * tp_s,
        m * pp_s,
        bubble,
        dp_exposed,
        opt,
        m * cp_s,
        slot_max,
        slot_avg,
        m * ep_s,
        offload,
    )
