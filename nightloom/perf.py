"""FLOPs per token, MFU and the peak FLOP/s it divides by: the one formula and the one peak rule, used by
planner, trainer and validation.

Source (cited once, here): Chowdhery et al. 2022, "PaLM", Appendix B:
    FLOPs/token = 6·N + 12·L·H·Q·T     (N non-embedding params, L layers, H heads, Q head dim, T seq len)
    MFU = tokens/s · FLOPs/token / (GPUs · peak FLOP/s)
HFU additionally counts recomputed forward FLOPs (full recompute: one extra forward = +2·N + 4·L·H·Q·T per token).
Sliding-window layers (Mistral, Gemma 3): a query attends to at most W keys (Beltagy et al. 2020, "Longformer",
§3.1: windowed attention costs O(n·w), not O(n²)), so PaLM's attention term is summed per layer with the keys a
query sees: 12·H·Q·Σ_l T_l, T_l = min(W, T) on a sliding layer and T on a global one (= 12·L·H·Q·T when no window
is shorter than T). Like PaLM's T (which ignores the causal mask), min(W, T) ignores the first W tokens' shorter
windows. The native model runs a sliding layer as masked dense SDPA, so its hardware work is still ~T per query:
the count is what a kernel that skips masked blocks (flash, flex attention) does, as MFU should be.
Mixture of experts: a token runs only its top-k routed experts (and the shared ones), so FLOPs per token follow
the *activated* parameters: 6·N_active + attention (Fedus et al. 2022, "Switch Transformers", §2: more parameters
at a constant FLOPs per token; the DeepSeek-V3 report, arXiv 2412.19437 §4.2, and Megatron-Core's MoE MFU count
the same way). N_active counts the router (h·E per MoE layer, every token computes all E logits) and k + shared
experts; the total (all experts) is what memory holds. Multi-head latent attention (DeepSeek-V3 §2.1.1) counts
its low-rank projections in N and its attention core as 6·H·(d_qk + d_v)·T (PaLM's 12·H·Q·T with d_qk = d_v = Q).
Frozen base weights (LoRA/QLoRA): Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1, split the
6·N into 2·N forward and 4·N backward, half of which is weight gradients; frozen weights need none, so the base
costs 4·N (the attention term is all activation work and stays). The adapters' own 6·N_adapter is left out
(under 1% of N for the usual ranks), so LoRA MFU is slightly understated, never overstated.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from nightloom.catalog import GPUS
from nightloom.shape import ModelShape


def attention_params(shape: ModelShape) -> int:
    """Parameters of one layer's attention (projections, their biases, q/k norms; MLA's low-rank projections and
    their norms)."""
    h, H = shape.hidden, shape.heads
    if shape.kv_lora_rank:  # multi-head latent attention (DeepSeek-V2/V3)
        qk, rope, v = shape.head_dim, shape.qk_rope_head_dim, shape.v_head_dim or shape.head_dim
        r_q, r_kv = shape.q_lora_rank, shape.kv_lora_rank
        q = (h * r_q + r_q + r_q * H * qk) if r_q else h * H * qk
        kv = h * (r_kv + rope) + r_kv + r_kv * H * (qk - rope + v)
        return q + kv + H * v * h
    q_dim, kv_dim = H * shape.head_dim, shape.kv_heads * shape.head_dim
    attn = 2 * h * q_dim + 2 * h * kv_dim  # q, k, v, o
    attn += (q_dim + 2 * kv_dim) * shape.qkv_bias + h * shape.o_bias
    return attn + 2 * shape.head_dim * shape.qk_norm  # qwen3's / gemma3's q/k norms (one head_dim weight each)


def mlp_params(shape: ModelShape, ffn: int) -> int:
    """Parameters of one MLP (dense, or one expert) of intermediate size `ffn`."""
    h = shape.hidden
    return (3 if shape.gated_mlp else 2) * h * ffn + ((2 if shape.gated_mlp else 1) * ffn + h) * shape.mlp_bias


def layer_mlp_params(shape: ModelShape, layer: int, active: bool = False) -> int:
    """Parameters of layer `layer`'s feed-forward part: a dense MLP, or the router (h·E), the routed experts (all
    of them, or the top-k a token runs with `active`) and the shared experts."""
    if not shape.is_moe_layer(layer):
        return mlp_params(shape, shape.ffn_hidden)
    routed = shape.experts_per_token if active else shape.num_experts
    return shape.hidden * shape.num_experts + (routed + shape.shared_experts) * mlp_params(
        shape, shape.expert_ffn_hidden
    )


def expert_params(shape: ModelShape) -> int:
    """Parameters of every routed expert of the model (what expert parallelism shards); 0 for a dense model."""
    return shape.moe_layers * shape.num_experts * mlp_params(shape, shape.expert_ffn_hidden)


def count_params(shape: ModelShape, include_embeddings: bool = True, active: bool = False) -> int:
    """Exact parameter count of the decoder built by nightloom.train.model (an MoE model's total: every expert);
    `active=True`: the parameters one token runs through (top-k routed + shared experts, the router)."""
    h, L = shape.hidden, shape.layers
    norms = 2 * h + 2 * h * shape.post_norms  # gemma3: norms after attention and after the MLP
    if shape.moe:
        mlp = sum(layer_mlp_params(shape, i, active) for i in range(L))
    else:
        mlp = L * mlp_params(shape, shape.ffn_hidden)
    body = L * (attention_params(shape) + norms) + mlp + h  # + final norm
    if not include_embeddings:
        return body
    emb = shape.vocab * h
    head = 0 if shape.tied_embeddings else shape.vocab * h
    return body + emb + head


def active_params(shape: ModelShape, include_embeddings: bool = True) -> int:
    """Parameters a token is computed with (= count_params for a dense model)."""
    return count_params(shape, include_embeddings, active=True)


def flops_per_token(
    shape: ModelShape,
    seq_len: int,
    recompute: str = "none",
    hardware: bool = False,
    lm_head: bool = False,
    frozen_base: bool = False,
) -> float:
    """Training FLOPs per token (PaLM App. B). With hardware=True, count recomputation too (HFU).

    lm_head=True adds the output projection's 6·vocab·hidden (forward + backward, never recomputed), as
    Narayanan et al. 2021 count it (their V/(16·l·h) term); PaLM's formula leaves it out. frozen_base=True
    (LoRA/QLoRA) drops the base weights' gradient FLOPs: 4·N instead of 6·N (see the module docstring).
    Norms, qwen3's per-head q/k norms and gemma3's post-norms included, count only through their weights in N, as
    PaLM's 6·N does: their elementwise work (a few FLOPs per activation, under 0.1% of a layer's matmuls) is not
    counted apart, nor is Gemma's embedding scale or logit soft-capping. Sliding-window layers count
    min(window, seq_len) keys per query; an MoE model counts its activated parameters (module docstring)."""
    n = count_params(shape, include_embeddings=False, active=True)  # an MoE model's activated parameters
    keys = shape.attended_keys(seq_len)  # L·T without a shorter window
    attn = 6 * shape.heads * (shape.head_dim + (shape.v_head_dim or shape.head_dim)) * keys  # 12·H·Q·T when d_v = Q
    per_param = 4 if frozen_base else 6
    model = per_param * n + attn + (per_param * shape.vocab * shape.hidden if lm_head else 0)
    if not hardware or recompute == "none":
        return float(model)
    if recompute == "full":  # one extra forward pass: 1/3 of the 6N + attention term
        return float(model + (2 * n + attn / 3))
    # selective: only the attention core (softmax(QK^T)V) is recomputed: its forward share
    return float(model + attn / 3)


def mfu(tokens_per_s: float, flops_per_tok: float, n_devices: int, peak_flops_per_device: float) -> float:
    """Model (or hardware, given HFU FLOPs) FLOPs utilisation, PaLM App. B."""
    if peak_flops_per_device <= 0 or n_devices <= 0:
        raise ValueError(f"peak FLOP/s ({peak_flops_per_device}) and devices ({n_devices}) must be positive")
    return tokens_per_s * flops_per_tok / (n_devices * peak_flops_per_device)


class PeakError(ValueError):
    """No trustworthy peak FLOP/s for a device type (never silently defaulted: that is how MFU > 100% happens)."""


@dataclass(frozen=True)
class Peak:
    """Per-device peak FLOP/s, its precision and where it came from ("datasheet: ..." or "measured: ...")."""

    flops: float
    precision: str
    source: str

    @property
    def measured_on_cpu(self) -> bool:
        """A one-thread CPU matmul timed at the run's start: a host busy at that moment measures it low (3x apart
        on a loaded 2-core box), so an MFU above 100% of it says more about the host than about the FLOP count."""
        return self.source.startswith("measured") and "1 thread" in self.source


#: a measured peak is a Peak whose source says how it was measured (one record, two names)
PeakMeasurement = Peak


def resolve_precision(precision: str, device: str) -> str:
    """The spec's `auto` precision, the one rule: fp32 on CPU (`device == "cpu"`), bf16 on any GPU; an
    explicit fp32/bf16 is kept."""
    if precision == "auto":
        return "fp32" if device == "cpu" else "bf16"
    return precision


def resolve_peak(gpu_type: str, precision: str, measured: Peak | None = None) -> Peak:
    """The peak for a device type: the catalog datasheet for a GPU, a measurement for `cpu`; else PeakError."""
    precision = resolve_precision(precision, gpu_type)
    if gpu_type == "cpu":
        if measured is None:
            raise PeakError("gpu_type 'cpu': no measured peak given (use nightloom.perf.measure_cpu_matmul_peak)")
        if not (measured.flops > 0 and math.isfinite(measured.flops)):
            raise PeakError(f"gpu_type 'cpu': measured peak must be a positive number, got {measured.flops}")
        return Peak(measured.flops, measured.precision, measured.source)
    spec = GPUS.get(gpu_type)
    if spec is None:
        raise PeakError(f"no peak FLOP/s for GPU type {gpu_type!r}; known: cpu, {', '.join(sorted(GPUS))}")
    return Peak(spec.peak(precision), precision, f"datasheet: {spec.source}")


#: the one CPU peak measurement (native trainer and XTuner backend alike): square fp32 matmuls of this size,
#: best of this many, on one thread
CPU_PEAK_N, CPU_PEAK_REPEATS = 1024, 5


def cpu_matmul_peak_source(dtype: str = "fp32", n: int = CPU_PEAK_N, repeats: int = CPU_PEAK_REPEATS) -> str:
    """How measure_cpu_matmul_peak measured: the Peak's `source` (ranks that did not measure name it too)."""
    return f"measured: torch.mm {n}x{n} {dtype}, best of {repeats}, 1 thread"


def measure_cpu_matmul_peak(
    n: int = CPU_PEAK_N, repeats: int = CPU_PEAK_REPEATS, dtype: str = "fp32"
) -> PeakMeasurement:
    """Best-of-`repeats` square matmul FLOP/s on this CPU, one thread: the peak used for CPU MFU. The caller's
    torch thread count is set to 1 for the measurement and restored (an orchestrator process runs one thread per
    core, a training rank one: both must measure the same thing)."""
    import torch

    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(n, n, dtype=dt)
        b = torch.randn(n, n, dtype=dt)
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    flops = 2 * n**3 / best
    return PeakMeasurement(flops, dtype, cpu_matmul_peak_source(dtype, n, repeats))
