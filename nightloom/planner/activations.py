"""Activations one transformer layer saves for backward, per micro-batch: what the trainer holds in flight.

Two counts:
- `saved_bytes_per_token`, the default (fused attention), is the trainer's own: every tensor autograd keeps for one
  block of nightloom/train/model.py, listed from the shape (tests/unit/planner/test_activation_count.py measures a
  real block with saved-tensor hooks and checks this count per family). Per token, in 16-bit activations (2 bytes):
    norm inputs        2·h per RMSNorm (2, or 4 with Gemma's post-norms; the normalisation is recomputed)
    linear inputs      2·h for the QKV projections and 2·h for the MLP's (the norms' outputs)
    attention          q 2·q_dim, k and v 2·kv_dim each (SDPA's own GQA; repeated to q_dim where a mask or CP needs
                       it), the output 2·q_dim (also the o projection's input), the log-sum-exp 4·heads (fp32);
                       a sliding-window layer's mask, kept as a 16-bit bias of seq × seq: 2·seq (selective: 1·seq)
    q/k norms          2·(q_dim + kv_dim) (Qwen3, Gemma 3)
    MLP                gated: g, u and their product, 3 · 2·ffn (act(g) recomputed); GELU: 2 · 2·ffn
    routed MLP (MoE)   per routed copy (k): its input 2·h, g/u/product 3 · 2·f_e, the output 2·h for the weighted
                       sum; the shared experts' g/u/product 3 · 2·f_e each; the router's fp32 probabilities 4·E
    latent attention   deepseek_v3's MLA in place of q/k/v/output: `latent_attention_bytes_per_token`
  Under TP everything after a column-parallel projection is split (/t). Sequence parallel splits the norms' inputs
  (/t) and the linears' inputs: they are all-gathered first, but the trainer saves their sequence shard and gathers
  it again in backward (train/sp_shard.py), as Megatron's linears do; under train.compile torch's TP saves the
  gathered tensor (not /t: `gathered_sp`). Context parallel: the trainer repeats K/V to q_dim for torch's ring; an all-gather trainer (Llama 3's,
  Grattafiori et al. 2024 §3.3.2) keeps the gathered, unrepeated K/V of the whole sequence for its attention. Selective recompute drops the log-sum-exp (SDPA's inputs and output stay saved); full keeps the input.
- `table2_bytes_per_token`, Korthikanti et al. 2022 Table 2 (`fused_attention=False`): GPT with dropout, MHA, a 4h
  GELU MLP and materialised attention scores, the reference rows' stack (PTD-P):
    no recompute       t=1: h·(34 + 5·a·s/h)   TP: h·(10 + 24/t + 5·a·s/(h·t))   TP+SP: h·(34 + 5·a·s/h)/t
    selective          TP+SP: 34·h/t  (TP without SP: h·(10 + 24/t))
    full               2·h (the layer input; /t when SP shards it)
  with the q/k norms', post-norms' and routed experts' terms added as their own tensors.
"""

from __future__ import annotations

from nightloom.shape import ModelShape

#: bytes per activation element (bf16/fp16 activations; the fp32 log-sum-exp and router probabilities apart)
ACT_BYTES = 2


def saved_bytes_per_token(
    shape: ModelShape,
    seq: int,
    tp: int,
    sp: bool,
    recompute: str,
    cp: int = 1,
    other_trainer: bool = False,
    gathered_sp: bool = False,
) -> float:
    """Bytes one (mean) layer saves per token of a micro-batch, as the trainer runs it (fused attention);
    `gathered_sp`: the linears keep their all-gathered input under SP (torch's TP as it is, train.compile)."""
    h, t, b = shape.hidden, tp, ACT_BYTES
    seq_shard = t if sp else 1
    if recompute == "full":
        return b * h / seq_shard
    norms = 2 + 2 * shape.post_norms
    lin_shard = t if sp and (other_trainer or not gathered_sp) else 1
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    masked = sliding_fraction(shape, seq)
    # SDPA's own GQA keeps K/V unrepeated on the causal (maskless) layers; masked layers and torch's CP repeat them;
    # an all-gather CP trainer saves the gathered K/V: cp blocks per local token
    kv_held = kv_dim if cp == 1 else (cp * kv_dim if other_trainer else q_dim)
    kv_saved = (1 - masked) * kv_held + masked * q_dim
    lse = 0.0 if recompute == "selective" else 4 * shape.heads / t
    # a masked layer's SDPA keeps the boolean mask as a 16-bit additive bias, seq × seq on every TP rank (selective:
    # the recomputed SDPA's input, the boolean mask itself)
    mask = masked * seq * (1 if recompute == "selective" else b)
    attn = b * (2 * q_dim + 2 * kv_saved) / t + lse + mask
    if shape.mla:
        attn = latent_attention_bytes_per_token(shape, t, recompute)
    qk = b * (q_dim + kv_dim) / t if shape.qk_norm else 0.0
    out = b * h * norms / seq_shard + 2 * b * h / lin_shard + attn + qk
    return out + mlp_bytes_per_token(shape, t)


def latent_attention_bytes_per_token(shape: ModelShape, tp: int, recompute: str) -> float:
    """What one multi-head latent attention (train/model.py LatentAttention) saves per token, beside its input and
    the normed input the norms' and linears' terms count: the low-rank query's latent and its norm (2 · r_q), the
    key/value projection's output (r_kv + rope; its norm's input is a view of it) and the norm's output (r_kv);
    SDPA's q, k and zero-padded v of every head at the key width, its output (none: also at the key width, with the
    narrower slice copied for the o projection) and log-sum-exp; selective recompute keeps SDPA's inputs and the o
    projection's input only."""
    b, heads, qk, v = ACT_BYTES, shape.heads / tp, shape.head_dim, shape.v_head_dim
    latent = 2 * shape.q_lora_rank + 2 * shape.kv_lora_rank + shape.qk_rope_head_dim
    if recompute == "selective":
        return b * (latent + heads * (3 * qk + v))
    out = heads * (qk + (v if v < qk else 0))
    return b * (latent + heads * 3 * qk + out) + 4 * heads


def mlp_bytes_per_token(shape: ModelShape, tp: int) -> float:
    """The MLP's saved tensors per token (mean over layers: routed layers where the shape has experts)."""
    b = ACT_BYTES
    dense = (3 if shape.gated_mlp else 2) * b * shape.ffn_hidden / tp
    if not shape.moe:
        return dense
    k, f_e = shape.experts_per_token, shape.expert_ffn_hidden / tp
    # the shared experts are one SwiGLU on the layer's input (train/moe.py SharedExperts): g, u, product only
    routed = k * (2 * b * shape.hidden + 3 * b * f_e) + shape.shared_experts * 3 * b * f_e + 4 * shape.num_experts
    share = shape.moe_layers / shape.layers
    return share * routed + (1 - share) * dense


def sliding_fraction(shape: ModelShape, seq: int) -> float:
    """Share of layers that attend through a mask at `seq` (a sliding window shorter than the sequence)."""
    if not shape.windowed(seq):
        return 0.0
    return sum(shape.is_sliding(i) for i in range(shape.layers)) / shape.layers


def table2_bytes_per_token(shape: ModelShape, seq: int, mb: int, tp: int, sp: bool, recompute: str) -> float:
    """Korthikanti et al. 2022 Table 2 per token of a micro-batch (materialised scores; see the module docstring)."""
    s, h, a, t = seq, shape.hidden, shape.heads, tp
    attn = 5 * a * s / h
    if recompute == "full":
        return 2 * h / (t if sp else 1)
    norms = (qk_norm_bytes(shape, seq, mb, tp) + post_norm_bytes(shape, seq, mb, tp, sp)) / (seq * mb)
    norms += moe_table2_bytes(shape, seq, mb, tp, recompute) / (seq * mb)
    if recompute == "selective":
        return (34 * h / t if sp else h * (10 + 24 / t)) + norms
    if t == 1:
        return h * (34 + attn) + norms
    if sp:
        return h * (34 + attn) / t + norms
    return h * (10 + 24 / t + attn / t) + norms


def moe_table2_bytes(shape: ModelShape, seq: int, mb: int, tp: int, recompute: str) -> float:
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
    /t under SP, replicated under TP alone; 0 without them."""
    if not shape.post_norms:
        return 0.0
    return 2 * 2 * seq * mb * shape.hidden / (tp if sp else 1)


def activation_bytes_per_layer(
    shape: ModelShape,
    seq: int,
    mb: int,
    tp: int,
    sp: bool,
    recompute: str,
    fused_attention: bool = True,
    cp: int = 1,
    other_trainer: bool = False,
    gathered_sp: bool = False,
) -> float:
    """Saved activations of one (mean) layer for one micro-batch of `seq` tokens (this rank's share under CP): the
    trainer's count with fused attention, Table 2's with materialised scores."""
    if not fused_attention:
        return seq * mb * table2_bytes_per_token(shape, seq, mb, tp, sp, recompute)
    return seq * mb * saved_bytes_per_token(shape, seq, tp, sp, recompute, cp, other_trainer, gathered_sp)
