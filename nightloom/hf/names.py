"""Native parameter names <-> Hugging Face llama/mistral/qwen2/qwen3/gemma3_text names (the same tensors, no
permutation).

The native model uses the rotate-half RoPE layout of transformers, so Q/K rows load as they are stored. Gemma's
`post_attention_layernorm` is the norm AFTER attention (Llama's is the one before the MLP, Gemma's
`pre_feedforward_layernorm`), so the layer names depend on `shape.post_norms`. A gemma3 image-text checkpoint
keeps the same decoder tensors under a prefix (`decoder_body`, `text_name`) beside a vision tower and projector.

Mixture-of-experts layers keep the Hub's per-expert layout on disk, what transformers 5.24's
save_pretrained writes: one tensor per expert and matrix (`mlp.experts.N.gate_proj.weight`, or as the
family's `expert_block` names them), the router at `mlp.gate.weight` (`<block>.gate.weight`). The
native model stacks each matrix over the experts (`ffn.experts.w1`, (E, ffn, hidden)): `expert_names` lists the
per-expert names of one stacked tensor, in expert order. A checkpoint in transformers 5's fused in-memory names
(`mlp.experts.gate_up_proj` (E, 2·ffn, hidden), gate rows first; `mlp.experts.down_proj`; the router at
`mlp.gate.weight` for mixtral too) is read as well (`fused_expert_source`); exports use the Hub's layout."""

from __future__ import annotations

import re

from nightloom.families import families, family_for
from nightloom.shape import ModelShape

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",  # qwen3
    "attn.k_norm": "self_attn.k_norm",
    "ffn.w1": "mlp.gate_proj",
    "ffn.w3": "mlp.up_proj",
    "ffn.w2": "mlp.down_proj",
    # deepseek_v3: multi-head latent attention and the shared experts
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.q_a_norm": "self_attn.q_a_layernorm",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attn.kv_a_norm": "self_attn.kv_a_layernorm",
    "attn.wkv_b": "self_attn.kv_b_proj",
    "ffn.shared.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared.w3": "mlp.shared_experts.up_proj",
    "ffn.shared.w2": "mlp.shared_experts.down_proj",
}
#: Gemma 3: norms before and after attention and MLP
_GEMMA_LAYER = {
    **_LAYER,
    "attn_post_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_post_norm.weight": "post_feedforward_layernorm.weight",
}
_EXPERTS_RE = re.compile(r"layers\.(\d+)\.ffn\.experts\.(w[123])")
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
#: tensors of a gemma3 image-text checkpoint that are not its text decoder (left out: not trained, not exported)
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")
#: where an image-text checkpoint keeps the text decoder's `model.*` tensors: transformers 5's module names, and
#: the Hub's files (what save_pretrained writes: transformers maps `language_model.model` back on save)
IMAGE_TEXT_BODIES = ("model.language_model.", "language_model.model.")
#: an image-text checkpoint's untied head: `lm_head.weight`, or the Hub's `language_model.lm_head.weight`
IMAGE_TEXT_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


def to_hf(name: str, shape: ModelShape | None = None) -> str:
    """`layers.3.attn.wq.weight` -> `model.layers.3.self_attn.q_proj.weight` (Gemma's names with a shape whose
    `post_norms` is set)."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.fullmatch(name)
    if m and shape is not None and shape.moe and m.group(2) == "ffn.router.weight":
        return f"model.layers.{m.group(1)}.{_moe_names(shape)[0]}.gate.weight"
    if m and m.group(2) == "ffn.router_bias":  # deepseek_v3's expert-choice bias (a buffer)
        return f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias"
    if m:
        rest = m.group(2)
        for ours, theirs in (_GEMMA_LAYER if shape is not None and shape.post_norms else _LAYER).items():
            if rest == ours or rest.startswith(ours + "."):
                return f"model.layers.{m.group(1)}.{theirs}{rest[len(ours) :]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def _moe_names(shape: ModelShape) -> tuple[str, dict[str, str]]:
    """The family's expert block: (module prefix, {native stacked name: per-expert matrix name})."""
    family = family_for(shape.arch)
    if family is None or family.expert_block is None:
        known = ", ".join(f.name for f in families() if f.expert_block is not None)
        raise KeyError(f"model {shape.name}: no Hugging Face expert names for {shape.arch!r} ({known})")
    return family.expert_block


def expert_names(name: str, shape: ModelShape) -> list[str] | None:
    """The Hugging Face names of the E slices of a stacked expert tensor (`layers.1.ffn.experts.w1` ->
    `model.layers.1.mlp.experts.{0..E-1}.gate_proj.weight`); None when `name` is not one."""
    m = _EXPERTS_RE.fullmatch(name)
    if m is None:
        return None
    block, mats = _moe_names(shape)
    layer, which = m.group(1), mats[m.group(2)]
    return [f"model.layers.{layer}.{block}.experts.{e}.{which}.weight" for e in range(shape.num_experts)]


def fused_expert_source(name: str, shape: ModelShape) -> tuple[str, int | None] | None:
    """Where a stacked expert tensor lies in transformers 5's fused layout: (name, 0 for the gate rows / 1 for the
    up rows of `gate_up_proj`, None for the whole tensor); None when `name` is not a stacked expert tensor."""
    m = _EXPERTS_RE.fullmatch(name)
    if m is None:
        return None
    p = f"model.layers.{m.group(1)}.mlp.experts."
    return {"w1": (p + "gate_up_proj", 0), "w3": (p + "gate_up_proj", 1), "w2": (p + "down_proj", None)}[m.group(2)]


def fused_router(name: str) -> str:
    """The router's name in the fused layout (`layers.3.ffn.router.weight` -> `model.layers.3.mlp.gate.weight`)."""
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) != "ffn.router.weight":
        raise KeyError(f"{name!r} is not a router weight")
    return f"model.layers.{m.group(1)}.mlp.gate.weight"


def holds_fused_experts(names) -> bool:
    """Whether a checkpoint's tensor names are transformers 5's fused expert layout (not the Hub's per-expert one)."""
    return any(n.endswith(".mlp.experts.gate_up_proj") for n in names)


def expected_shapes(shape: ModelShape, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this model holds, by HF name, with its shape (unpadded vocab);
    `fused`: MoE layers in transformers 5's fused names instead of the Hub's per-expert layout.

    A tied model's checkpoint may or may not hold `lm_head.weight` (transformers omits it): see `optional`."""
    h, d, v = shape.hidden, shape.head_dim, shape.vocab
    q, kv, f = shape.heads * d, shape.kv_heads * d, shape.ffn_hidden
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not shape.tied_embeddings:
        out["lm_head.weight"] = (v, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        if shape.post_norms:
            out |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if shape.mla:
            out |= _latent_attention(shape, p)
        else:
            out |= {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
            }
        if shape.is_moe_layer(i) and shape.router_score == "sigmoid":
            out[p + "mlp.gate.e_score_correction_bias"] = (shape.num_experts,)
        if shape.is_moe_layer(i) and shape.shared_experts:
            fs = shape.shared_experts * shape.expert_ffn_hidden
            out |= {p + f"mlp.shared_experts.{n}.weight": (fs, h) for n in ("gate_proj", "up_proj")}
            out[p + "mlp.shared_experts.down_proj.weight"] = (h, fs)
        if shape.is_moe_layer(i) and fused:
            fe, n = shape.expert_ffn_hidden, shape.num_experts
            out |= {p + "mlp.gate.weight": (n, h), p + "mlp.experts.gate_up_proj": (n, 2 * fe, h)}
            out[p + "mlp.experts.down_proj"] = (n, h, fe)
        elif shape.is_moe_layer(i):
            block, mats = _moe_names(shape)
            fe, mat = shape.expert_ffn_hidden, {"w1": (shape.expert_ffn_hidden, h), "w3": (shape.expert_ffn_hidden, h)}
            mat["w2"] = (h, fe)
            out[f"{p}{block}.gate.weight"] = (shape.num_experts, h)
            for e in range(shape.num_experts):
                out |= {f"{p}{block}.experts.{e}.{mats[k]}.weight": mat[k] for k in ("w1", "w3", "w2")}
        else:
            out |= {
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        if shape.qkv_bias:
            out |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if shape.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if shape.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if shape.mlp_bias:
            out |= {p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,), p + "mlp.down_proj.bias": (h,)}
    return out


def _latent_attention(shape: ModelShape, p: str) -> dict[str, tuple[int, ...]]:
    """A deepseek_v3 layer's attention tensors (transformers' DeepseekV3Attention)."""
    h, heads, qk, rope, r = shape.hidden, shape.heads, shape.head_dim, shape.qk_rope_head_dim, shape.kv_lora_rank
    a = p + "self_attn."
    out = {
        a + "kv_a_proj_with_mqa.weight": (r + rope, h),
        a + "kv_a_layernorm.weight": (r,),
        a + "kv_b_proj.weight": (heads * (qk - rope + shape.v_head_dim), r),
        a + "o_proj.weight": (h, heads * shape.v_head_dim),
    }
    if shape.q_lora_rank:
        rq = shape.q_lora_rank
        return out | {
            a + "q_a_proj.weight": (rq, h),
            a + "q_a_layernorm.weight": (rq,),
            a + "q_b_proj.weight": (heads * qk, rq),
        }
    return out | {a + "q_proj.weight": (heads * qk, h)}


def optional(shape: ModelShape) -> set[str]:
    """Names a checkpoint may hold without the model needing them (a tied model's duplicate head)."""
    return {"lm_head.weight"} if shape.tied_embeddings else set()


def decoder_body(stored: list[str]) -> str:
    """The prefix a checkpoint keeps the text decoder's `model.*` tensors under: `model.` (a text model) or one
    of IMAGE_TEXT_BODIES; ValueError when it holds the decoder under both."""
    bodies = [b for b in IMAGE_TEXT_BODIES if any(n.startswith(b) for n in stored)]
    if len(bodies) > 1:
        raise ValueError(f"holds a text decoder under both {bodies[0]}* and {bodies[1]}*")
    return bodies[0] if bodies else "model."


def text_name(stored: str, body: str) -> str | None:
    """The text model's Hugging Face name of a stored tensor whose checkpoint keeps its decoder under `body`
    (`language_model.model.layers.0.x` -> `model.layers.0.x`); None for an image-text checkpoint's vision tower
    and projector. A name of neither kind comes back as it is (then unexpected)."""
    if body == "model.":
        return stored
    if stored.startswith(body):
        return "model." + stored[len(body) :]
    if stored in IMAGE_TEXT_HEADS:
        return "lm_head.weight"
    if stored.startswith(VISION_PREFIXES):
        return None
    return stored
