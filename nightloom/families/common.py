"""What several families' config readers share: positive-integer fields, RoPE in both spellings, the refusals
every native family makes, and the llama-style config.json an export writes from a shape.

No family names here: a family's own unit (nightloom/families/<family>.py) holds its defaults and differences."""

from __future__ import annotations

from nightloom.shape import ModelShape, RopeScaling

_ROPE_KINDS = ("default", "linear", "llama3", "yarn")


def need_field(cfg: dict, *keys: str, where: str = "", model_type: str | None = None) -> int:
    """The first of `keys` set in `cfg`, a positive integer; ValueError naming the field (and the model_type,
    `cfg`'s own unless given, when none is set)."""
    for k in keys:
        if cfg.get(k) is not None:
            v = cfg[k]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{where}{k}: expected a positive integer, got {v!r}")
            return v
    raise ValueError(
        f"{' or '.join(keys)}: required for model_type {model_type or cfg.get('model_type')!r} but missing"
    )


def decoder_fields(cfg: dict, where: str = "", model_type: str | None = None) -> dict:
    """The ModelShape fields every decoder's config spells alike (layers, widths, heads, vocabulary, context, tied
    embeddings, the RMSNorm epsilon), each integer checked by need_field."""

    def need(key: str) -> int:
        return need_field(cfg, key, where=where, model_type=model_type)

    heads = need("num_attention_heads")
    return dict(
        layers=need("num_hidden_layers"),
        hidden=need("hidden_size"),
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        ffn_hidden=need("intermediate_size"),
        vocab=need("vocab_size"),
        max_seq=need("max_position_embeddings"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings")),
        norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
    )


def with_defaults(cfg: dict, defaults: dict) -> dict:
    """`cfg` with `defaults` filled in where a field is absent or null (what transformers' config class reads)."""
    return {**cfg, **{k: v for k, v in defaults.items() if cfg.get(k) is None}}


def rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` (transformers 5) or top-level `rope_theta` + `rope_scaling`."""
    field = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    return rope_of(cfg.get(field) or {}, field, cfg, float(cfg.get("rope_theta", 10000.0)))


def rope_or_plain(cfg: dict, strict: bool) -> tuple[float, RopeScaling | None]:
    """rope, or where not strict (a shape read for FLOPs only) the plain theta when the scaling is unsupported."""
    try:
        return rope(cfg)
    except ValueError:
        if strict:
            raise
        return float(cfg.get("rope_theta", 10000.0)), None


def rope_of(params, field: str, cfg: dict, theta: float) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of one RoPE parameter object named `field` (its own rope_theta overrides `theta`)."""
    if not isinstance(params, dict):
        raise ValueError(f"{field}: expected an object, got {params!r}")
    theta = float(params.get("rope_theta", theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise ValueError(f"{field}.rope_type: {kind!r} is not supported (supported: {', '.join(_ROPE_KINDS)})")
    for where, src in ((f"{field}.", params), ("", cfg)):
        partial = src.get("partial_rotary_factor")
        if partial not in (None, 1, 1.0):
            raise ValueError(f"{where}partial_rotary_factor: {partial!r} is not supported (only 1.0)")
    if kind == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"{field}.factor: required for rope_type {kind!r}")
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "yarn":
        return theta, _yarn(params, field)
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"{field}.{missing[0]}: required for rope_type 'llama3'")
    orig = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, RopeScaling(
        "llama3",
        float(params["factor"]),
        float(params["low_freq_factor"]),
        float(params["high_freq_factor"]),
        int(orig),
    )


def _yarn(params: dict, field: str) -> RopeScaling:
    """A YaRN scaling (transformers' keys and defaults: beta_fast 32, beta_slow 1, truncate true)."""
    if params.get("original_max_position_embeddings") is None:
        raise ValueError(f"{field}.original_max_position_embeddings: required for rope_type 'yarn'")

    def num(key: str) -> float | None:
        v = params.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{field}.{key}: expected a number, got {v!r}")
        return None if v is None else float(v)

    return RopeScaling(
        "yarn",
        float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=num("beta_fast") or 32.0,
        beta_slow=num("beta_slow") or 1.0,
        mscale=num("mscale"),
        mscale_all_dim=num("mscale_all_dim"),
        attention_factor=num("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def refuse_dropout(cfg: dict, where: str = "") -> None:
    """attention_dropout other than 0: the native model has no dropout."""
    drop = cfg.get("attention_dropout", 0.0) or 0.0
    if float(drop) != 0.0:
        raise ValueError(f"{where}attention_dropout: {drop!r} is not supported (the native model has no dropout)")


def refuse_quantized(cfg: dict, where: str = "", only: str = "unquantized weights only") -> None:
    """A quantization_config: the native model loads unquantized weights only."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"{where}quantization_config: {method!r} weights are not supported ({only})")


def rope_entry(theta: float, scaling: RopeScaling | None) -> dict:
    """One `rope_parameters` object as transformers 5 writes it."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    entry = {"rope_type": scaling.kind, "rope_theta": theta, "factor": scaling.factor}
    if scaling.kind == "llama3":
        entry.update(
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    return entry


def llama_style_export(shape: ModelShape, architecture: str) -> dict:
    """The fields every llama-style config class reads, written from the shape (a family's export adds its own)."""
    return {
        "architectures": [architecture],
        "model_type": shape.arch,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.ffn_hidden,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_seq,
        "rms_norm_eps": shape.norm_eps,
        "tie_word_embeddings": shape.tied_embeddings,
        "hidden_act": "silu",
        "attention_bias": shape.o_bias,
        "mlp_bias": shape.mlp_bias,
        "rope_parameters": rope_entry(shape.rope_theta, shape.rope_scaling),
    }
