"""Gemma 3's text decoder: gemma3_text, and the `text_config` of a gemma3 image-text config (the decoder only).

Gemma 3's math goes into the Gemma fields of ModelShape; fields a config leaves out take transformers'
Gemma3TextConfig defaults (the Hub's image-text configs leave most of text_config out)."""

from __future__ import annotations

from nightloom.families.common import (
    decoder_fields,
    llama_style_export,
    refuse_dropout,
    refuse_quantized,
    rope_entry,
    rope_of,
)
from nightloom.families.registry import Family, register
from nightloom.shape import LAYER_TYPES, ModelShape, RopeScaling

ARCHITECTURE = "Gemma3ForCausalLM"
#: transformers 5.24's Gemma3TextConfig class defaults, for fields a gemma3 config.json leaves out
DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,  # older configs: every 6th layer global, when layer_types is absent
    "rope_theta": 1_000_000.0,  # global layers (with rope_scaling)
    "rope_local_base_freq": 10_000.0,  # sliding layers (never scaled)
}


def _text_config(cfg: dict) -> tuple[dict, str]:
    """(the decoder's config with transformers' defaults filled in, the prefix its field names take in errors)."""
    where = ""
    if cfg.get("model_type") == "gemma3":
        text = cfg.get("text_config") or {}
        if not isinstance(text, dict):
            raise ValueError(f"text_config: expected an object, got {text!r}")
        where = "text_config."
        # the image-text model ties its head by the top-level flag (Gemma3Config, default true: transformers
        # writes text_config's own flag as true even for an untied model), quantizes as a whole
        top = {k: cfg[k] for k in ("quantization_config",) if k in cfg}
        cfg = {**top, **text, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}
    return {**DEFAULTS, **cfg}, where


def _layer_types(cfg: dict, where: str) -> tuple[str, ...]:
    """`layer_types`, or the older `sliding_window_pattern` (layer i global when (i + 1) % pattern == 0)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or 6
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n))
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"{where}layer_types: expected a list of num_hidden_layers ({n}) entries, got {types!r}")
    odd = sorted({t for t in types if t not in LAYER_TYPES})
    if odd:
        raise ValueError(f"{where}layer_types: {', '.join(map(str, odd))} is not supported ({', '.join(LAYER_TYPES)})")
    return tuple(types)


def _rope(cfg: dict, where: str) -> tuple[float, RopeScaling | None, float]:
    """(global theta, global scaling, local theta): transformers 5's `rope_parameters` keyed by layer type, or
    the Hub's top-level `rope_theta` + `rope_scaling` (global layers only) + `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES):
            raise ValueError(f"{where}rope_parameters: expected one object per layer type ({', '.join(LAYER_TYPES)})")
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta, scaling = rope_of(full, f"{where}rope_parameters.full_attention", cfg, cfg["rope_theta"])
        local_field = f"{where}rope_parameters.sliding_attention"
    else:
        theta, scaling = rope_of(cfg.get("rope_scaling") or {}, f"{where}rope_scaling", cfg, cfg["rope_theta"])
        local, local_field = {}, f"{where}rope_local_base_freq"
    local_theta, local_scaling = rope_of(local, local_field, cfg, cfg["rope_local_base_freq"])
    if local_scaling is not None:
        raise ValueError(f"{local_field}.rope_type: {local_scaling.kind!r} is not supported on sliding layers")
    return theta, scaling, local_theta


def _refuse(cfg: dict, where: str) -> None:
    """Gemma 3 fields whose value would change the math the native model computes, by name."""
    act = cfg.get("hidden_activation")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{where}hidden_activation: {act!r} is not supported (only gelu_pytorch_tanh)")
    refuse_dropout(cfg, where)
    cap = cfg.get("attn_logit_softcapping")
    if cap is not None:
        raise ValueError(
            f"{where}attn_logit_softcapping: {cap!r} is not supported (Gemma 2 style score capping; transformers' "
            "Gemma3 does not apply it either, so a checkpoint trained with it would not score the same there)"
        )
    final_cap = cfg.get("final_logit_softcapping")
    if where and final_cap is not None:
        raise ValueError(
            f"{where}final_logit_softcapping: {final_cap!r} is not supported in an image-text config (transformers' "
            "Gemma3ForConditionalGeneration does not apply it, the text-only export's Gemma3ForCausalLM would)"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{where}use_bidirectional_attention: true is not supported (causal decoders only)")
    refuse_quantized(cfg, where, only="unquantized only")


def read(cfg: dict, name: str, strict: bool) -> ModelShape:
    """Gemma 3's text decoder: (1 + w) RMSNorms before and after attention and MLP, q/k norms, embeddings times
    sqrt(hidden), GeGLU, query_pre_attn_scalar, sliding layers with their own RoPE base, final logit capping."""
    model_type = cfg.get("model_type")
    cfg, where = _text_config(cfg)

    if strict:
        _refuse(cfg, where)
    fields = decoder_fields(cfg, where, model_type)
    hidden, heads = fields["hidden"], fields["heads"]
    types = _layer_types(cfg, where)
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{where}sliding_window: expected a positive integer, got {window!r}")
    if window is None and "sliding_attention" in types:
        raise ValueError(f"{where}sliding_window: required when layer_types has sliding_attention layers")
    try:
        theta, scaling, local_theta = _rope(cfg, where)
    except ValueError:
        if strict:
            raise
        theta, scaling, local_theta = float(cfg["rope_theta"]), None, float(cfg["rope_local_base_freq"])
    head_dim = cfg.get("head_dim") or hidden // heads
    bias = bool(cfg.get("attention_bias", False))
    cap = cfg.get("final_logit_softcapping")
    return ModelShape(
        name=name,
        **fields,
        rope_theta=theta,
        explicit_head_dim=head_dim if head_dim != hidden // heads or hidden % heads else None,
        rope_scaling=scaling,
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=window,
        qk_norm=True,
        arch="gemma3_text",
        norm_offset=1.0,
        post_norms=True,
        embed_scale=True,
        mlp_act="gelu_tanh",
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        layer_types=types,
        rope_local_theta=local_theta,
        final_logit_softcap=float(cap) if cap is not None else None,
    )


def _export_fields(shape: ModelShape) -> dict:
    """The gemma3_text fields of an export written from the shape (what Gemma3TextConfig reads)."""
    scalar = shape.query_pre_attn_scalar or shape.head_dim
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": shape.o_bias,
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,  # Gemma3TextConfig: an int
        "sliding_window": shape.sliding_window,
        "layer_types": list(shape.layer_types),
        "rope_parameters": {
            "full_attention": rope_entry(shape.rope_theta, shape.rope_scaling),
            "sliding_attention": rope_entry(shape.rope_local_theta or shape.rope_theta, None),
        },
        "final_logit_softcapping": shape.final_logit_softcap,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def export_source(source: dict) -> dict:
    """A gemma3 image-text config's text decoder as a gemma3_text config (the export holds the decoder only)."""
    cfg = {k: v for k, v in source.items() if k in ("tie_word_embeddings", "bos_token_id", "eos_token_id")}
    cfg |= dict(source.get("text_config") or {})
    cfg |= {
        "model_type": "gemma3_text",
        "architectures": [ARCHITECTURE],
        "tie_word_embeddings": bool(source.get("tie_word_embeddings", True)),  # the image-text model's flag
    }
    return cfg


def _export_source(source: dict) -> dict:
    """An image-text source gives its text decoder; a gemma3_text source is written as it is."""
    return export_source(source) if source.get("model_type") == "gemma3" else dict(source)


def _export(shape: ModelShape) -> dict:
    cfg = llama_style_export(shape, ARCHITECTURE)
    del cfg["hidden_act"], cfg["mlp_bias"]
    return cfg | _export_fields(shape)


register(
    Family(
        name="gemma3",
        model_types=("gemma3_text", "gemma3"),  # gemma3: an image-text config; its text_config is the decoder
        read=read,
        architecture=ARCHITECTURE,
        export=_export,
        export_source=_export_source,
        hf_classes=("Gemma3TextConfig", "Gemma3ForCausalLM"),
        norm_unit=0.0,
        xtuner_added="4.50",
    )
)
