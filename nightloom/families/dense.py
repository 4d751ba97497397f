"""The dense llama-style families: llama, mistral, qwen2, qwen3 — one reader, their differences as data.

Every field of their config that changes the math is honoured or refused by name: num_key_value_heads, head_dim,
rope_theta and RoPE scaling in both spellings (transformers 4.x / the Hub's top-level `rope_theta` +
`rope_scaling`, transformers 5's `rope_parameters`), rms_norm_eps, tie_word_embeddings, attention_bias / mlp_bias
(qwen2 always has q/k/v bias), hidden_act, sliding windows. qwen3 adds a per-head RMSNorm on q and k (`qk_norm`);
where its config leaves a field out, transformers' Qwen3Config default applies (head_dim 128, num_key_value_heads
32), as `from_pretrained` would read it. The mixture-of-experts families whose attention is one of these
(qwen3_moe, mixtral: nightloom/families/moe.py) read through `dense_shape` too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nightloom.families.common import (
    decoder_fields,
    llama_style_export,
    refuse_dropout,
    refuse_quantized,
    rope_or_plain,
    with_defaults,
)
from nightloom.families.registry import Family, register
from nightloom.shape import ModelShape

#: a mixture-of-experts family's ModelShape fields from its config (defaults filled in) and layer count
MoeFields = Callable[[dict, int], dict]


@dataclass(frozen=True)
class Dense:
    """What one dense model_type does differently (attention biases, windows, q/k norms, config defaults)."""

    model_type: str
    architecture: str
    qkv_bias_always: bool = False  # qwen2: q/k/v have a bias whatever attention_bias says
    o_bias: bool = False  # attention_bias covers the output projection too
    mlp_bias: bool = False  # mlp_bias is honoured
    sliding_window: bool = False  # sliding_window is read (mistral)
    refuse_sliding: bool = False  # use_sliding_window: true is refused (qwen2, qwen3)
    qk_norm: bool = False
    defaults: dict = field(default_factory=dict)  # transformers' config class defaults (not the Llama rule)
    hf_classes: tuple[str, str] | None = None
    xtuner_added: str | None = None


LLAMA = Dense("llama", "LlamaForCausalLM", o_bias=True, mlp_bias=True, hf_classes=("LlamaConfig", "LlamaForCausalLM"))
MISTRAL = Dense(
    "mistral", "MistralForCausalLM", sliding_window=True, hf_classes=("MistralConfig", "MistralForCausalLM")
)
QWEN2 = Dense(
    "qwen2",
    "Qwen2ForCausalLM",
    qkv_bias_always=True,
    refuse_sliding=True,
    hf_classes=("Qwen2Config", "Qwen2ForCausalLM"),
)
QWEN3 = Dense(
    "qwen3",
    "Qwen3ForCausalLM",
    o_bias=True,
    refuse_sliding=True,
    qk_norm=True,
    defaults={"head_dim": 128, "num_key_value_heads": 32},
    hf_classes=("Qwen3Config", "Qwen3ForCausalLM"),
    xtuner_added="4.51",
)


def refuse_unsupported(cfg: dict, dense: Dense) -> None:
    """Fields whose non-default value would change the math the native model computes."""
    if dense.refuse_sliding and cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window: true is not supported (sliding-window attention)")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported (the native model uses silu / SwiGLU)")
    refuse_dropout(cfg)
    refuse_quantized(cfg)
    layer_types = cfg.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(f"layer_types: {', '.join(other)} is not supported (only full_attention)")


def dense_shape(
    cfg: dict, name: str, strict: bool, dense: Dense, arch: str | None = None, moe: MoeFields | None = None
) -> ModelShape:
    """The shape of a config whose attention and norms are `dense`'s (`arch` and `moe(cfg, layers)`'s fields: a
    mixture-of-experts family built on it, whose defaults its caller fills in)."""
    if strict:
        refuse_unsupported(cfg, dense)
    if arch is None:
        cfg = with_defaults(cfg, dense.defaults)
    fields = decoder_fields(cfg)
    heads, hidden = fields["heads"], fields["hidden"]
    head_dim = cfg.get("head_dim")
    theta, scaling = rope_or_plain(cfg, strict)
    attn_bias = bool(cfg.get("attention_bias", False))
    return ModelShape(
        name=name,
        **fields,
        gated_mlp=True,
        rope_theta=theta,
        explicit_head_dim=head_dim if head_dim and head_dim != hidden // heads else None,
        rope_scaling=scaling,
        qkv_bias=attn_bias or dense.qkv_bias_always,
        o_bias=attn_bias and dense.o_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and dense.mlp_bias,
        sliding_window=cfg.get("sliding_window") if dense.sliding_window else None,
        qk_norm=dense.qk_norm,
        arch=arch or dense.model_type,
        **(moe(cfg, fields["layers"]) if moe else {}),
    )


def dense_export(shape: ModelShape, dense: Dense) -> dict:
    """A config.json of `dense`'s family written from the shape (what its transformers config class reads)."""
    cfg = llama_style_export(shape, dense.architecture)
    if dense.qk_norm:  # qwen3: attention_bias covers q/k/v and o alike; no mlp_bias in Qwen3Config
        cfg |= {"attention_bias": shape.qkv_bias, "use_sliding_window": False}
        del cfg["mlp_bias"]
    if dense.sliding_window:
        cfg["sliding_window"] = shape.sliding_window
    return cfg


def dense_family(dense: Dense) -> Family:
    """The registered unit of one dense model_type."""
    return Family(
        name=dense.model_type,
        model_types=(dense.model_type,),
        read=lambda cfg, name, strict: dense_shape(cfg, name, strict, dense),
        architecture=dense.architecture,
        export=lambda shape: dense_export(shape, dense),
        hf_classes=dense.hf_classes,
        xtuner_added=dense.xtuner_added,
    )


for _dense in (LLAMA, MISTRAL, QWEN2, QWEN3):
    register(dense_family(_dense))
