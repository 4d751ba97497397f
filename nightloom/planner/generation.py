"""Post-training's passes without a backward on the planner's GPU model: a no-grad forward (DPO's reference, GRPO's
prefill and its KL reference) and the decode of GRPO's rollouts, with the KV cache they hold.

The inference roofline (Pope et al. 2022, "Efficiently Scaling Transformer Inference", §2-3; the roofline of
Williams et al. 2009): a pass takes the longer of its FLOPs at the compute peak and its bytes at the memory
bandwidth. A forward over many tokens (a prefill, a reference pass) is compute-bound: perf.flops_per_token / 3 a
token (2·N, the attention's forward, the head's 2·V·h where logits are made), at the planner's efficiency. A decode
step makes one token per row: few FLOPs, but every weight of the rank (sharded by TP; gathered whole by FSDP2 for
the rollout, train/rollout/generate.gathered) and every cached K and V are read once, so it is bound by HBM
bandwidth: (weight bytes + KV bytes) / the datasheet's hbm_bw (catalog.GPUSpec, e.g. H100 SXM 3.35 TB/s). The KV
cache holds K and V of every layer for every row and token: 2 · layers · kv_heads · head_dim · bytes (the native
cache is (B, kv_heads/tp, prompt + completion, head_dim) per layer, train/rollout/kv_cache.py). Tensor parallel adds
2 all-reduces per layer of the new tokens' activations, as training does (steptime.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from nightloom.catalog import GPUSpec
from nightloom.parallel import ParallelDims
from nightloom.perf import flops_per_token
from nightloom.planner.memory import stage_params
from nightloom.planner.steptime import group_bandwidth, ring_s
from nightloom.shape import ModelShape


def element_bytes(precision: str) -> int:
    """Bytes of a weight or activation element as the planner counts them (fp32 training: 4; bf16, fp8: 2)."""
    return 4 if precision == "fp32" else 2


def kv_bytes_per_token(shape: ModelShape, tp: int, ebytes: int) -> float:
    """K and V of one token in every layer on one TP rank: layers · kv_heads/tp · (head_dim + v_head_dim) · bytes."""
    v_dim = shape.v_head_dim or shape.head_dim
    return shape.layers * shape.kv_heads / tp * (shape.head_dim + v_dim) * ebytes


def forward_flops(shape: ModelShape, context: int, head: bool = True) -> float:
    """FLOPs of one token's forward attending `context` tokens: the training count's forward third (perf.py's
    6·N + attention + 6·V·h, PaLM App. B), without the head's 2·V·h when no logits are made for the token."""
    return flops_per_token(shape, context, lm_head=head) / 3


def tp_allreduce_s(shape: ModelShape, c: ParallelDims, tokens: float, gpu: GPUSpec, gpn: int, ebytes: int) -> float:
    """One forward's tensor-parallel all-reduces: 2 a layer (attention's and the MLP's row-parallel outputs) of the
    new tokens' tokens·h activations."""
    if c.tp == 1:
        return 0.0
    bw, lat = group_bandwidth("tp", c, gpn, gpu)
    return 2 * shape.layers * ring_s(c.tp, tokens * shape.hidden * ebytes, bw, lat, 2.0)


def no_grad_forward_s(
    shape: ModelShape,
    c: ParallelDims,
    rows: int,
    per_forward: int,
    seq: int,
    gpu: GPUSpec,
    gpn: int,
    efficiency: float,
    precision: str,
) -> float:
    """Seconds of a no-grad forward of `rows` sequences of `seq` tokens on one rank, `per_forward` rows at a time,
    logits for every token (a reference's log-probs): compute-bound, plus TP's all-reduces per forward."""
    ebytes = element_bytes(precision)
    peak = gpu.peak(precision) * efficiency
    compute = rows * seq * forward_flops(shape, seq) / c.tp / peak
    forwards = -(-rows // max(per_forward, 1))
    return compute + forwards * tp_allreduce_s(shape, c, per_forward * seq, gpu, gpn, ebytes)


@dataclass(frozen=True)
class Generation:
    """One rollout on one rank: its seconds (prefill, decode, FSDP2's gather) and the bytes it holds."""

    rows: int
    prompt: int
    completion: int
    prefill_s: float
    decode_s: float
    gather_s: float
    decode_bound: str  # "memory" or "compute": what bounds a decode step
    weight_bytes: float  # the rank's weights, read once per decode step
    kv_bytes: float  # the KV cache when full (every row at prompt + completion tokens)
    working_bytes: float  # the largest transient: the prefill's MLP intermediates of one layer

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s + self.gather_s


def generation(
    shape: ModelShape,
    c: ParallelDims,
    rows: int,
    prompt: int,
    completion: int,
    gpu: GPUSpec,
    gpn: int,
    efficiency: float,
    precision: str,
) -> Generation:
    """A rollout of `rows` prompts of `prompt` tokens to `completion` tokens each on one rank, batched as
    train/rollout/generate.py does (all rows at once; the prefill's last logits give the first token, then
    completion − 1 cached steps). Every row is priced at its longest: a sampled batch runs until its last row ends."""
    ebytes = element_bytes(precision)
    peak = gpu.peak(precision) * efficiency
    hbm = gpu.hbm_bw or 2e12
    weights = stage_params(shape, c.tp, 1, c.ep)[0] * ebytes  # the rank's whole stage (pp = 1), FSDP2-gathered
    per_token_kv = kv_bytes_per_token(shape, c.tp, ebytes)
    head = 2 * shape.vocab * shape.hidden
    prefill = rows * (prompt * forward_flops(shape, prompt, head=False) + head) / c.tp / peak
    prefill += tp_allreduce_s(shape, c, rows * prompt, gpu, gpn, ebytes)
    steps = max(completion - 1, 0)
    mean_ctx = prompt + completion / 2  # the cache grows by one slot a step: its mean length over the decode
    read = weights + rows * mean_ctx * per_token_kv
    flops = rows * forward_flops(shape, int(mean_ctx)) / c.tp
    memory_s, compute_s = read / hbm, flops / peak
    step = max(memory_s, compute_s) + tp_allreduce_s(shape, c, rows, gpu, gpn, ebytes)
    gather = 0.0
    if c.shard > 1:  # FSDP2 unshards every module once for the whole rollout (generate.gathered)
        bw, lat = group_bandwidth("dp_shard", c, gpn, gpu)
        gather = ring_s(c.shard, weights, bw, lat, 1.0)
    mlp = (3 if shape.gated_mlp else 2) * shape.ffn_hidden / c.tp
    return Generation(
        rows=rows,
        prompt=prompt,
        completion=completion,
        prefill_s=prefill,
        decode_s=steps * step,
        gather_s=gather,
        decode_bound="memory" if memory_s >= compute_s else "compute",
        weight_bytes=weights,
        kv_bytes=rows * (prompt + completion) * per_token_kv,
        working_bytes=rows * prompt * mlp * ebytes,
    )
