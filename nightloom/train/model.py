"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, tied or untied embeddings; with
`shape.qk_norm` the per-head q/k RMSNorm of Qwen3; with the Gemma 3 fields of ModelShape the (1 + w) norms, the
norms after attention and MLP, scaled embeddings, GeGLU, query_pre_attn_scalar, sliding-window layers with their
own RoPE base and final logit soft-capping; with `shape.mla` DeepSeek's multi-head latent attention,
`LatentAttention`).

Layers live in an `nn.ModuleDict` keyed by their GLOBAL index ("0".."L-1"), so a pipeline stage that drops
layers keeps the same parameter names and checkpoints do not depend on the layout. Embedding, final norm
and head may be `None` on stages that do not own them. Parameters are initialised per parameter from a
generator seeded by (seed, name), so any subset of the model (a pipeline stage) gets the same values as
the full model built in one process.

Sliding-window layers run SDPA with an explicit boolean mask (causal and within the window), built per call from
the sequence length: the same math on CPU and GPU, no compile step, and what transformers' sdpa path computes.
A flex-attention block mask would skip the blocks outside the window (attention work ~ T·W instead of T²) but
needs torch.compile to be fast and has no CPU path the tests could compare; the FLOP count (perf.py) counts the
window's work, as a kernel that skips blocks would do it. Packed pretraining windows keep plain causal attention
across document boundaries, as every other layer does.

Packed sft rows (train.pack) pass `doc_ids` (B, T) to `Transformer.forward`: attention is block-causal (causal AND
the same document, AND the window on sliding layers) through one boolean mask per forward and window, shared by
every layer, and RoPE takes each id's position within its document (the tables gathered per row). Without
`doc_ids` nothing changes: no mask, the fused causal kernel.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nightloom.shape import ModelShape, RopeScaling
from nightloom.train.moe import MoEFeedForward
from nightloom.train.recompute import recomputed


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019). offset 0: Llama's (normalised x in x's dtype) * w. offset 1: Gemma's
    (normalised x * (1 + w)) in fp32, then x's dtype (transformers' Gemma3RMSNorm; weights stored around 0)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Saved for backward: only x. Plain autograd would keep an fp32 copy of x and the normalised x (6 bytes per
        # element of a bf16 x, 3x x itself); the normalisation is recomputed in backward instead (a few elementwise
        # ops; the same ops, so the same gradients). The planner counts what is saved (planner/activations.py).
        return recomputed(self._normalise, x)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (out * (self.offset + self.weight.float())).type_as(x)
        return out.type_as(x) * self.weight


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) of rotary embeddings (Su et al. 2021), with a Hugging Face RoPE scaling.

    linear: all / factor. llama3 (Meta's Llama 3.1 reference, as transformers' `_compute_llama3_parameters`):
    wavelengths above original/low_freq_factor are divided by factor, below original/high_freq_factor kept,
    and smoothly interpolated in between."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_inv_freq(inv, head_dim, theta, scaling)
    if scaling.kind != "llama3":
        raise ValueError(f"rope scaling {scaling.kind!r} is not supported")
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies: dimension d rotates orig·inv[d]/2π times over the original length; those rotating more
    than beta_fast times keep their frequency (extrapolation), fewer than beta_slow are divided by the factor
    (interpolation), a linear ramp in between (Peng et al. 2023 §3.2, "NTK-by-parts")."""

    def dim_of(rotations: float) -> float:  # the dimension index that rotates `rotations` times
        return (
            head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv / s.factor * (1 - keep) + inv * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1·mscale·ln(factor) + 1 (Peng et al. 2023 §3.4; 1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What YaRN scales cos/sin by (so every rotated q·k by its square); 1 for the other kinds."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def rope_tables(
    head_dim: int, seq_len: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (seq_len, head_dim/2) of rotary embeddings (YaRN's scaled by its attention factor)."""
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
    f = rope_attention_factor(scaling)
    return ang.cos() * f, ang.sin() * f


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + head_dim/2]) (the rotate-half layout of Hugging Face checkpoints, so their Q/K
    rows load unpermuted); x is (B, T, heads, head_dim), cos/sin are (T, head_dim/2), or (B, T, head_dim/2)
    gathered per row (packed documents)."""
    xf = x.float()
    x0, x1 = xf.chunk(2, dim=-1)
    if cos.dim() == 3:
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    else:
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).type_as(x)


def window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """(t, t) boolean mask, True where query i may see key j: j <= i and i - j < window (transformers'
    sliding_window_overlay on its causal mask: the token itself and the window - 1 before it). One tensor per
    (t, window, device) is shared by every layer, so the copies SDPA saves for backward are one (t² bytes: 64 MiB
    at t = 8192, not 64 MiB per sliding layer)."""
    return _window_mask(t, window, torch.device(device), torch.is_inference_mode_enabled())


@functools.lru_cache(maxsize=4)
def _window_mask(t: int, window: int, device: torch.device, inference: bool) -> torch.Tensor:
    # keyed on inference mode too: a tensor made under inference_mode cannot be saved for a later backward
    i = torch.arange(t, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


@dataclass
class DocumentMask:
    """Packed rows' documents: the (B, T) document id of every position, each document a contiguous run. Builds
    each attention mask once per forward (per window size) and each layer's RoPE tables gathered by position."""

    doc_ids: torch.Tensor
    positions: torch.Tensor = field(init=False)
    _masks: dict = field(default_factory=dict, init=False, repr=False)
    _ropes: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        d = self.doc_ids
        t = torch.arange(d.shape[1], device=d.device).expand_as(d)
        new = torch.ones_like(d, dtype=torch.bool)
        new[:, 1:] = d[:, 1:] != d[:, :-1]
        start = torch.where(new, t, torch.zeros_like(t)).cummax(dim=1).values  # first position of its document
        self.positions = t - start

    def mask(self, window: int | None) -> torch.Tensor:
        """(B, 1, T, T) boolean: query i sees key j when j <= i, both in one document (and i - j < window)."""
        if window not in self._masks:
            d, i = self.doc_ids, torch.arange(self.doc_ids.shape[1], device=self.doc_ids.device)
            dist = i[:, None] - i[None, :]
            m = (d[:, :, None] == d[:, None, :]) & (dist >= 0)
            if window is not None:
                m = m & (dist < window)
            self._masks[window] = m[:, None]
        return self._masks[window]

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables (T_max, head_dim/2) at each id's position in its document: (B, T, head_dim/2)."""
        key = (cos.data_ptr(), sin.data_ptr())
        if key not in self._ropes:
            self._ropes[key] = (cos[self.positions], sin[self.positions])
        return self._ropes[key]


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, layer: int = 0):
        super().__init__()
        self.head_dim = shape.head_dim
        self.rep = shape.heads // shape.kv_heads
        self.window = shape.sliding_window if shape.is_sliding(layer) else None
        # Gemma: scores scaled by query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5; 27B: 168 vs head_dim 128)
        self.scale = shape.query_pre_attn_scalar**-0.5 if shape.query_pre_attn_scalar else None
        q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.wq = nn.Linear(shape.hidden, q_dim, bias=shape.qkv_bias)
        self.wk = nn.Linear(shape.hidden, kv_dim, bias=shape.qkv_bias)
        self.wv = nn.Linear(shape.hidden, kv_dim, bias=shape.qkv_bias)
        self.wo = nn.Linear(q_dim, shape.hidden, bias=shape.o_bias)
        # Qwen3: RMSNorm over head_dim of every q and k head (one weight shared by the heads), before RoPE.
        # Under TP each rank normalises its own heads; the weight is replicated (parallelize.py).
        self.q_norm = RMSNorm(shape.head_dim, shape.norm_eps, shape.norm_offset) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.norm_eps, shape.norm_offset) if shape.qk_norm else None
        self.recompute_core = False  # selective recompute: only softmax(QK^T)V is recomputed
        #: grouped-query K/V repeated to every query head before SDPA (what ring attention under CP needs); else
        #: SDPA's own GQA (enable_gqa) where its fused kernel has it, which saves K and V unrepeated for backward
        self.expand_kv = False

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`mask` (packed documents: DocumentMask.mask, the window included) with cos/sin already per row."""
        b, t, _ = x.shape
        # view(..., -1, head_dim): under TP the local projection holds heads/tp heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if cos.dim() == 2:
            cos, sin = cos[:t], sin[:t]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # a window as long as the sequence is plain causal attention (and keeps the fused causal kernel)
        if mask is None and self.window is not None and self.window < t:
            mask = window_mask(t, self.window, q.device)
        gqa = self.rep > 1 and native_gqa(q, mask, self.expand_kv)
        if self.rep > 1 and not gqa:
            k = k.repeat_interleave(self.rep, dim=2)
            v = v.repeat_interleave(self.rep, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        attend = functools.partial(recomputed, _sdpa) if self.recompute_core else _sdpa  # selective: core only
        o = attend(q, k, v, mask, self.scale, gqa)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, transformers' DeepseekV3Attention): the query through an optional
    low-rank projection (wq_a, q_a_norm, wq_b; else wq), keys and values from one compressed latent (wkv_a ->
    kv_a_norm -> wkv_b, per head a no-RoPE key part and the value) plus one rotary key part shared by every head.
    Each head's key is [k_nope, k_rot], its query [q_nope, q_rot]; values may be narrower than keys. RoPE rotates
    only the rope part; DeepSeek's checkpoints lay it out in interleaved pairs, taken apart first (`rope_interleave`:
    the same dot products as transformers' apply_rotary_pos_emb_interleave). Scores scale by qk_head_dim ** -0.5
    (under YaRN with mscale_all_dim, times its temperature squared)."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        h, heads = shape.hidden, shape.heads
        self.nope, self.rope = shape.head_dim - shape.qk_rope_head_dim, shape.qk_rope_head_dim
        self.v_dim, self.kv_rank, self.interleave = shape.v_head_dim, shape.kv_lora_rank, shape.rope_interleave
        self.window = None  # no sliding layers in this family
        if shape.q_lora_rank:
            self.wq_a = nn.Linear(h, shape.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(shape.q_lora_rank, shape.norm_eps)
            self.wq_b = nn.Linear(shape.q_lora_rank, heads * shape.head_dim, bias=False)
        else:
            self.wq = nn.Linear(h, heads * shape.head_dim, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, shape.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, h, bias=False)
        # scores scale by qk_head_dim ** -0.5, under YaRN with mscale_all_dim times its temperature squared
        # (transformers' yarn_apply_mscale for deepseek_v3)
        rs = shape.rope_scaling
        temp = yarn_mscale(rs.factor, rs.mscale_all_dim) if rs and rs.kind == "yarn" and rs.mscale_all_dim else 1.0
        self.scale = shape.head_dim**-0.5 * temp * temp if temp != 1.0 else None
        self.recompute_core = False
        self.expand_kv = False  # every head has its own K/V already

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q_nope, q_rot = q.view(b, t, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(latent)).view(b, t, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rot = k_rot.view(b, t, 1, self.rope)
        if self.interleave:  # pairs (x0, x1), (x2, x3), ... -> rotate-half's (x0, x2, ...; x1, x3, ...)
            q_rot, k_rot = (torch.cat((z[..., 0::2], z[..., 1::2]), dim=-1) for z in (q_rot, k_rot))
        if cos.dim() == 2:
            cos, sin = cos[:t], sin[:t]
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1).transpose(1, 2)
        k = torch.cat((k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)), dim=-1).transpose(1, 2)
        # values narrower than keys are zero-padded to the key width (and the output cut back): the fused kernels
        # (flash on CPU and CUDA) want one head size; a math fallback would store every score for backward
        pad = q.shape[-1] - self.v_dim
        v = (F.pad(v, (0, pad)) if pad > 0 else v).transpose(1, 2)
        attend = functools.partial(recomputed, _sdpa) if self.recompute_core else _sdpa  # selective: core only
        o = attend(q, k, v, mask, self.scale)
        return self.wo(o.transpose(1, 2)[..., : self.v_dim].reshape(b, t, -1))


def native_gqa(q: torch.Tensor, mask: torch.Tensor | None, expand_kv: bool) -> bool:
    """Can SDPA take K/V with fewer heads than Q (enable_gqa) and stay fused? Its flash kernels can (CPU: any dtype;
    CUDA: 16-bit); the masked path (memory-efficient kernel) and an fp32 CUDA run would fall back to the math kernel,
    which materialises the scores, and ring attention (CP) wants every head: those repeat K/V instead."""
    if mask is not None or expand_kv:
        return False
    return q.device.type == "cpu" or q.dtype in (torch.bfloat16, torch.float16)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    gqa: bool = False,
) -> torch.Tensor:
    """Causal attention, or within the boolean `mask` (sliding window) when given; `gqa`: K/V heads unrepeated."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)), GeGLU with tanh-approximated GELU (mlp_act "gelu_tanh": Gemma's
    gelu_pytorch_tanh) or, with gated_mlp=False, a GELU MLP."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.gated = shape.gated_mlp
        self.gelu_tanh = shape.mlp_act == "gelu_tanh"
        bias = shape.mlp_bias
        self.w1 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=bias)
        self.w2 = nn.Linear(shape.ffn_hidden, shape.hidden, bias=bias)
        self.w3 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=bias) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            g, u = self.w1(x), self.w3(x)
            # saved for backward: g and u (w2 saves the product); plain autograd would also keep act(g), a third
            # ffn-wide tensor: it is recomputed in backward (Megatron's fused SwiGLU saves the same two)
            return self.w2(recomputed(self._glu, g, u))
        return self.w2(F.gelu(self.w1(x)))

    def _glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (F.gelu(g, approximate="tanh") if self.gelu_tanh else F.silu(g)) * u


class Block(nn.Module):
    """Pre-norm block; with `shape.post_norms` (Gemma) the attention and MLP outputs are normalised again before
    their residual add: h = x + post(attn(pre(x)))."""

    def __init__(self, shape: ModelShape, layer: int = 0):
        super().__init__()
        eps, off = shape.norm_eps, shape.norm_offset
        self.attn_norm = RMSNorm(shape.hidden, eps, off)
        self.attn = LatentAttention(shape) if shape.mla else Attention(shape, layer)
        self.attn_post_norm = RMSNorm(shape.hidden, eps, off) if shape.post_norms else None
        self.ffn_norm = RMSNorm(shape.hidden, eps, off)
        # mixture of experts (train/moe.py): routed experts in place of the MLP, except on the model's dense layers
        self.ffn = MoEFeedForward(shape) if shape.is_moe_layer(layer) else FeedForward(shape)
        self.ffn_post_norm = RMSNorm(shape.hidden, eps, off) if shape.post_norms else None
        self.recompute_full = False  # full recompute: the whole block is recomputed in backward

    def _forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if mask is None:
            a = self.attn(self.attn_norm(x), cos, sin)
        else:  # a keyword: TP's PrepareModuleInput converts the positional (x, cos, sin) only
            a = self.attn(self.attn_norm(x), cos, sin, mask=mask)
        return self.after_attention(x, a)

    def after_attention(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The rest of the block once its attention gave `a` for input `x`: the post-norms where the family has
        them (Gemma 3), both residual adds and the feed-forward (also the KV-cached decoder's, train/rollout)."""
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)
        h = x + a
        f = self.ffn(self.ffn_norm(h))
        if self.ffn_post_norm is not None:
            f = self.ffn_post_norm(f)
        return h + f

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.recompute_full and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False)
        return self._forward(x, cos, sin, mask)


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab); on a middle pipeline stage hidden -> hidden."""

    def __init__(self, shape: ModelShape, seq_len: int | None = None):
        super().__init__()
        seq_len = seq_len or shape.max_seq
        self.shape = shape
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(shape.embed_rows, shape.hidden)
        self.layers = nn.ModuleDict({str(i): Block(shape, i) for i in range(shape.layers)})
        self.norm: RMSNorm | None = RMSNorm(shape.hidden, shape.norm_eps, shape.norm_offset)
        self.output: nn.Linear | None = nn.Linear(shape.hidden, shape.embed_rows, bias=False)
        self.offload = None  # parallel.offload_layers (set_offload): an ActivationOffload for these layers
        self.offloaded: frozenset[int] = frozenset()
        if shape.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        #: sqrt(hidden) as each embedding dtype holds it (bf16: sqrt(3072) = 55.5, not 55.4256)
        self._embed_scales = {
            dt: float(torch.tensor(shape.hidden**0.5, device="cpu").to(dt))
            for dt in (torch.float32, torch.bfloat16, torch.float16)
        }
        # non-persistent: recomputed, never checkpointed. Gemma's sliding layers have their own (unscaled) base.
        for prefix, (cos, sin) in self._rope_tables(seq_len).items():
            self.register_buffer(f"{prefix}_cos", cos, persistent=False)
            self.register_buffer(f"{prefix}_sin", sin, persistent=False)

    def _rope_tables(self, seq_len: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        s = self.shape
        tables = {"rope": rope_tables(s.rope_dim, seq_len, s.rope_theta, s.rope_scaling)}
        if s.rope_local_theta is not None:
            tables["rope_local"] = rope_tables(s.head_dim, seq_len, s.rope_local_theta)
        return tables

    def _layer_rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shape.rope_local_theta is not None and self.shape.is_sliding(layer):
            return self.rope_local_cos, self.rope_local_sin
        return self.rope_cos, self.rope_sin

    def to_empty(self, *, device, recurse: bool = True) -> Transformer:
        """Materialise on `device`; torch's to_empty gives the two users of a tied matrix two copies, so re-tie."""
        super().to_empty(device=device, recurse=recurse)
        if self.shape.tied_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight
        return self

    def keep_layers(self, first: int, last: int, has_embed: bool, has_head: bool) -> Transformer:
        """Drop everything a pipeline stage does not own (layers [first, last) keep their global names)."""
        for k in list(self.layers.keys()):
            if not first <= int(k) < last:
                del self.layers[k]
        if not has_embed:
            self.tok_embeddings = None
        if not has_head:
            self.norm = None
            self.output = None
        return self

    def expand_kv_heads(self) -> None:
        """Repeat grouped K/V heads before SDPA in every layer (context parallel: ring attention wants them)."""
        for block in self.layers.values():
            block.attn.expand_kv = True

    def set_offload(self, layers: set[int], device: torch.device) -> None:
        """parallel.offload_layers: what these layers (global indices) save waits in host memory (train/offload.py)."""
        from nightloom.train.offload import ActivationOffload

        self.offloaded = frozenset(layers)
        self.offload = ActivationOffload(device) if layers else None

    def set_recompute(self, mode: str) -> None:
        for block in self.layers.values():
            block.recompute_full = mode == "full"
            block.attn.recompute_core = mode == "selective"

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, head_loss=None) -> torch.Tensor:
        """`doc_ids` (B, T): packed documents (train.pack), attention block-causal and positions per document.
        `head_loss(hidden, head_weight) -> loss` (train/loss.py): the loss fused with the head, no logits here."""
        s = self.shape
        docs = DocumentMask(doc_ids) if doc_ids is not None else None
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if s.embed_scale:  # Gemma: sqrt(hidden) rounded to the embedding dtype first, as transformers does
                h = h * self._embed_scales[h.dtype]
        else:
            h = x
        if self.offload is not None:
            self.offload.begin(self, h)
        for key, block in self.layers.items():
            if docs is None:  # attention slices the tables to its (full) sequence length
                run = functools.partial(block, h, *self._layer_rope(int(key)))
            else:
                run = functools.partial(
                    block, h, *docs.rope(*self._layer_rope(int(key))), mask=docs.mask(block.attn.window)
                )
            h = run() if self.offload is None else self.offload.run(block, int(key) in self.offloaded, run)
        if self.offload is not None:
            self.offload.finish(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None and head_loss is not None:
            return head_loss(h, self.output.weight)
        if self.output is not None:
            h = self.output(h)
            if s.final_logit_softcap is not None:
                h = s.final_logit_softcap * torch.tanh(h / s.final_logit_softcap)
            if s.embed_rows != s.vocab:  # rows padded for TP are never predicted
                h = h[..., : s.vocab]
        return h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic per-parameter init from (seed, name): identical whatever subset this module holds."""
        for name, b in self.named_buffers():
            if name.endswith("router_bias"):  # DeepSeek's expert-choice bias starts at 0 (transformers' init)
                b.zero_()
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name == "norm.weight":
                p.fill_(1.0 - self.shape.norm_offset)  # a scale of 1; elementwise: the same on a shard as whole
                continue
            if name.endswith(".bias"):
                p.zero_()
                continue
            copy_global(p, self.init_value(name, p.shape, seed).to(p.dtype))
        for prefix, (cos, sin) in self._rope_tables(self.rope_cos.shape[0]).items():
            getattr(self, f"{prefix}_cos").copy_(cos)
            getattr(self, f"{prefix}_sin").copy_(sin)

    def init_value(self, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
        """The fp32 start of weight `name` (whole): N(0, 0.02), residual projections GPT-2's 0.02 / sqrt(2 L)."""
        std = 0.02
        if name.endswith(("attn.wo.weight", "ffn.w2.weight")):
            std = std / (2 * self.shape.layers) ** 0.5
        g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g, dtype=torch.float32).mul_(std)


def copy_global(p: torch.Tensor, full: torch.Tensor) -> None:
    """Set `p` to the global value `full`. A DTensor (TP/FSDP/replicate already applied on the meta device) takes
    only its own slice, cut locally (src_data_rank=None: no communication), so a rank never holds more than its
    shards plus one full parameter: what lets a 70B stage start on a GPU that cannot hold it whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        local = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)
    else:
        p.copy_(full)


def build_model(shape: ModelShape, seq_len: int | None = None, device: str | torch.device = "meta") -> Transformer:
    """The full model, on `device` (default meta: no memory; call to_empty + init_weights to materialise)."""
    with torch.device(device):
        return Transformer(shape, seq_len)


def param_count(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
