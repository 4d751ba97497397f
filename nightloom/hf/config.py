"""config.json -> ModelShape: the one parser of Hugging Face model configs (planner, trainer, XTuner, export).

Every field of a llama, mistral, qwen2 or qwen3 config that changes the math is honoured or refused by name:
num_key_value_heads, head_dim, rope_theta and RoPE scaling in both spellings (transformers 4.x / the Hub's
top-level `rope_theta` + `rope_scaling`, transformers 5's `rope_parameters`), rms_norm_eps,
tie_word_embeddings, attention_bias / mlp_bias (qwen2 always has q/k/v bias), hidden_act, sliding windows.
qwen3 adds a per-head RMSNorm on q and k (`qk_norm`); where its config leaves a field out, transformers'
Qwen3Config default applies (head_dim 128, num_key_value_heads 32), as `from_pretrained` would read it.
gemma3_text (and the `text_config` of a gemma3 image-text config: the text decoder only) reads Gemma 3's math
into the Gemma fields of ModelShape; fields it leaves out take transformers' Gemma3TextConfig defaults (the Hub's
image-text configs leave most of text_config out). The mixture-of-experts families are read too: qwen3_moe and
mixtral (attention as qwen3's and mistral's; the expert count, top-k, the layers that stay dense and the router
loss go into ModelShape's MoE fields) and deepseek_v3 (DeepSeek-V3, Moonlight, Kimi K2: multi-head latent
attention, shared experts, the first layers dense). gpt2 configs are read for planning only (their math is not
the native model's).
"""

from __future__ import annotations

import json
from pathlib import Path

from nightloom.shape import LAYER_TYPES, ModelShape, RopeScaling

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: mixture-of-experts families (the native trainer's: spec_checks.TRAINED_MOE); their attention is the family
#: named beside them
MOE_TYPES = {"qwen3_moe": "qwen3", "mixtral": "mistral", "deepseek_v3": "deepseek_v3"}
GEMMA3_TYPES = ("gemma3_text", "gemma3")  # gemma3: an image-text config; its text_config is the decoder
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
#: transformers' Qwen3Config class defaults for fields a config.json may leave out (not the Llama rule)
_QWEN3_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 32}
_ROPE_KINDS = ("default", "linear", "llama3", "yarn")
#: transformers 5.24's Gemma3TextConfig class defaults, for fields a gemma3 config.json leaves out
_GEMMA3_DEFAULTS = {
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


class HFConfigError(ValueError):
    """A config.json that cannot be used; the message names the file and the field."""


def config_path(path: str | Path) -> Path:
    """A config.json path from a file or a folder holding one."""
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def read_config(path: str | Path) -> dict:
    """The parsed config.json object; errors name the file (and line for bad JSON)."""
    p = config_path(path)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFConfigError(f"{p}: config file not found") from None
    except json.JSONDecodeError as err:
        raise HFConfigError(f"{p}:{err.lineno}: invalid JSON: {err.msg}") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` (transformers 5) or top-level `rope_theta` + `rope_scaling`."""
    field = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    return _rope_of(cfg.get(field) or {}, field, cfg, float(cfg.get("rope_theta", 10000.0)))


def _rope_or_plain(cfg: dict, strict: bool) -> tuple[float, RopeScaling | None]:
    """_rope, or where not strict (a shape read for FLOPs only) the plain theta when the scaling is unsupported."""
    try:
        return _rope(cfg)
    except ValueError:
        if strict:
            raise
        return float(cfg.get("rope_theta", 10000.0)), None


def _rope_of(params, field: str, cfg: dict, theta: float) -> tuple[float, RopeScaling | None]:
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


def _refuse_unsupported(cfg: dict, mtype: str) -> None:
    """Fields whose non-default value would change the math the native model computes."""
    if mtype in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window: true is not supported (sliding-window attention)")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported (the native model uses silu / SwiGLU)")
    drop = cfg.get("attention_dropout", 0.0) or 0.0
    if float(drop) != 0.0:
        raise ValueError(f"attention_dropout: {drop!r} is not supported (the native model has no dropout)")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"quantization_config: {method!r} weights are not supported (unquantized weights only)")
    layer_types = cfg.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(f"layer_types: {', '.join(other)} is not supported (only full_attention)")


def _gemma3_text_config(cfg: dict) -> tuple[dict, str]:
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
    return {**_GEMMA3_DEFAULTS, **cfg}, where


def _gemma3_layer_types(cfg: dict, where: str) -> tuple[str, ...]:
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


def _gemma3_rope(cfg: dict, where: str) -> tuple[float, RopeScaling | None, float]:
    """(global theta, global scaling, local theta): transformers 5's `rope_parameters` keyed by layer type, or
    the Hub's top-level `rope_theta` + `rope_scaling` (global layers only) + `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES):
            raise ValueError(f"{where}rope_parameters: expected one object per layer type ({', '.join(LAYER_TYPES)})")
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta, scaling = _rope_of(full, f"{where}rope_parameters.full_attention", cfg, cfg["rope_theta"])
        local_field = f"{where}rope_parameters.sliding_attention"
    else:
        theta, scaling = _rope_of(cfg.get("rope_scaling") or {}, f"{where}rope_scaling", cfg, cfg["rope_theta"])
        local, local_field = {}, f"{where}rope_local_base_freq"
    local_theta, local_scaling = _rope_of(local, local_field, cfg, cfg["rope_local_base_freq"])
    if local_scaling is not None:
        raise ValueError(f"{local_field}.rope_type: {local_scaling.kind!r} is not supported on sliding layers")
    return theta, scaling, local_theta


def _refuse_gemma3(cfg: dict, where: str) -> None:
    """Gemma 3 fields whose value would change the math the native model computes, by name."""
    act = cfg.get("hidden_activation")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{where}hidden_activation: {act!r} is not supported (only gelu_pytorch_tanh)")
    drop = cfg.get("attention_dropout", 0.0) or 0.0
    if float(drop) != 0.0:
        raise ValueError(f"{where}attention_dropout: {drop!r} is not supported (the native model has no dropout)")
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
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"{where}quantization_config: {method!r} weights are not supported (unquantized only)")


def _gemma3_shape(cfg: dict, name: str, strict: bool, need) -> ModelShape:
    """Gemma 3's text decoder: (1 + w) RMSNorms before and after attention and MLP, q/k norms, embeddings times
    sqrt(hidden), GeGLU, query_pre_attn_scalar, sliding layers with their own RoPE base, final logit capping."""
    cfg, where = _gemma3_text_config(cfg)
    if strict:
        _refuse_gemma3(cfg, where)
    layers, hidden, heads = need(cfg, "num_hidden_layers"), need(cfg, "hidden_size"), need(cfg, "num_attention_heads")
    types = _gemma3_layer_types(cfg, where)
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{where}sliding_window: expected a positive integer, got {window!r}")
    if window is None and "sliding_attention" in types:
        raise ValueError(f"{where}sliding_window: required when layer_types has sliding_attention layers")
    try:
        theta, scaling, local_theta = _gemma3_rope(cfg, where)
    except ValueError:
        if strict:
            raise
        theta, scaling, local_theta = float(cfg["rope_theta"]), None, float(cfg["rope_local_base_freq"])
    head_dim = cfg.get("head_dim") or hidden // heads
    bias = bool(cfg.get("attention_bias", False))
    cap = cfg.get("final_logit_softcapping")
    return ModelShape(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        ffn_hidden=need(cfg, "intermediate_size"),
        vocab=need(cfg, "vocab_size"),
        max_seq=need(cfg, "max_position_embeddings"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings")),
        norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
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


#: transformers 5.24's class defaults (Qwen3MoeConfig, MixtralConfig) for fields a config.json leaves out
_MOE_DEFAULTS = {
    "qwen3_moe": {
        "num_key_value_heads": 4,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001,
    },
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
}


def _experts(cfg: dict, *keys: str) -> int:
    """The routed expert count: the first of `keys` set (qwen3_moe Hub configs say num_experts; transformers 5.24
    writes num_local_experts with num_experts null)."""
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{k}: expected a positive integer, got {v!r}")
            return v
    return 128  # Qwen3MoeConfig's default (mixtral's key has its default filled in)


def _moe_fields(cfg: dict, moe_type: str, layers: int) -> dict:
    """The ModelShape MoE fields of a qwen3_moe or mixtral config. qwen3_moe: a layer is dense when it is listed
    in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (transformers' Qwen3MoeDecoderLayer); mixtral: every
    layer is sparse, experts of intermediate_size, the top-2 weights always renormalised."""
    if moe_type == "mixtral":
        experts, ffn, norm = _experts(cfg, "num_local_experts", "num_experts"), cfg["intermediate_size"], True
        dense: tuple[int, ...] = ()
    else:
        experts, ffn = _experts(cfg, "num_experts", "num_local_experts"), cfg["moe_intermediate_size"]
        norm = bool(cfg["norm_topk_prob"])
        only, step = cfg.get("mlp_only_layers") or [], cfg["decoder_sparse_step"]
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"decoder_sparse_step: expected a positive integer, got {step!r}")
        bad = [i for i in only if not isinstance(i, int) or not 0 <= i < layers]
        if bad:
            raise ValueError(f"mlp_only_layers: {bad} outside 0..{layers - 1}")
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return {
        "num_experts": experts,
        "experts_per_token": cfg["num_experts_per_tok"],
        "expert_ffn_hidden": ffn,
        "dense_layers": dense,
        "norm_topk_prob": norm,
        "router_aux_loss_coef": float(cfg["router_aux_loss_coef"]),
    }


#: transformers 5.24's DeepseekV3Config class defaults for fields a deepseek_v3 config.json may leave out
_DEEPSEEK_V3_DEFAULTS = {
    "q_lora_rank": 1536,  # null in a config (Moonlight) means a full query projection; absent means the default
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rope_interleave": True,
    "v_head_dim": 128,
}


def _deepseek_v3_shape(cfg: dict, name: str, need, strict: bool) -> ModelShape:
    """A deepseek_v3 config's shape (DeepSeek-V3, Moonlight, Kimi K2): multi-head latent attention, shared experts
    beside the routed ones, the first first_k_dense_replace layers dense, the sigmoid router grouped as
    transformers' DeepseekV3TopkRouter, YaRN RoPE scaling. strict: what the native model does not compute is refused
    by name (attention_bias, another activation, an older config's auxiliary-loss routing)."""
    cfg = {**cfg, **{k: v for k, v in _DEEPSEEK_V3_DEFAULTS.items() if k not in cfg}}
    layers = need("num_hidden_layers")
    freq = cfg.get("moe_layer_freq", 1) or 1
    first = cfg.get("first_k_dense_replace") or 0
    nope, rope = need("qk_nope_head_dim"), need("qk_rope_head_dim")
    theta, scaling = _rope_or_plain(cfg, strict)
    if strict:
        if cfg.get("attention_bias"):
            raise ValueError("attention_bias: true is not supported for deepseek_v3")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: {cfg['hidden_act']!r} is not supported (silu)")
        for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            if cfg.get(key) not in (None, want):
                raise ValueError(f"{key}: {cfg[key]!r} is not supported (transformers' deepseek_v3 runs {want})")
    heads = need("num_attention_heads")
    return ModelShape(
        name=name,
        layers=layers,
        hidden=need("hidden_size"),
        heads=heads,
        kv_heads=heads,
        ffn_hidden=need("intermediate_size"),
        vocab=need("vocab_size"),
        max_seq=need("max_position_embeddings"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        explicit_head_dim=nope + rope,
        arch="deepseek_v3",
        num_experts=need("n_routed_experts", "num_local_experts"),
        experts_per_token=need("num_experts_per_tok"),
        expert_ffn_hidden=need("moe_intermediate_size"),
        shared_experts=cfg.get("n_shared_experts") or 0,
        dense_layers=tuple(i for i in range(layers) if i < first or i % freq),
        norm_topk_prob=bool(cfg.get("norm_topk_prob")),
        router_score="sigmoid",
        router_groups=cfg.get("n_group") or 1,
        router_topk_groups=cfg.get("topk_group") or 1,
        routed_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=need("kv_lora_rank"),
        qk_rope_head_dim=rope,
        v_head_dim=cfg.get("v_head_dim") or nope + rope,
        rope_interleave=bool(cfg.get("rope_interleave")),
    )


def shape_from_config(cfg: dict, name: str = "hf", strict: bool = True) -> ModelShape:
    """A ModelShape from a parsed config.json; raises ValueError naming the field.

    strict=False reads the shape only (FLOP counts for a model another trainer runs, e.g. XTuner): fields the
    native model cannot compute are then not refused and an unsupported RoPE scaling is left out."""
    mtype = cfg.get("model_type")

    def need_in(src: dict, *keys: str, where: str = "") -> int:
        for k in keys:
            if src.get(k) is not None:
                v = src[k]
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ValueError(f"{where}{k}: expected a positive integer, got {v!r}")
                return v
        raise ValueError(f"{' or '.join(keys)}: required for model_type {mtype!r} but missing")

    def need(*keys: str) -> int:
        return need_in(cfg, *keys)

    if mtype in GEMMA3_TYPES:
        where = "text_config." if mtype == "gemma3" else ""
        return _gemma3_shape(cfg, name, strict, lambda src, k: need_in(src, k, where=where))
    if mtype == "deepseek_v3":
        return _deepseek_v3_shape(cfg, name, need, strict)
    if mtype in LLAMA_TYPES or mtype in MOE_TYPES:
        moe_type, mtype = (mtype, MOE_TYPES[mtype]) if mtype in MOE_TYPES else (None, mtype)
        if strict:
            _refuse_unsupported(cfg, mtype)
        if mtype == "qwen3" and moe_type is None:
            cfg = {**cfg, **{k: v for k, v in _QWEN3_DEFAULTS.items() if cfg.get(k) is None}}
        if moe_type is not None:
            cfg = {**cfg, **{k: v for k, v in _MOE_DEFAULTS[moe_type].items() if cfg.get(k) is None}}
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = cfg.get("head_dim")
        theta, scaling = _rope_or_plain(cfg, strict)
        attn_bias = bool(cfg.get("attention_bias", False))
        return ModelShape(
            name=name,
            layers=need("num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            ffn_hidden=need("intermediate_size"),
            vocab=need("vocab_size"),
            max_seq=need("max_position_embeddings"),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            gated_mlp=True,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            explicit_head_dim=head_dim if head_dim and head_dim != hidden // heads else None,
            rope_scaling=scaling,
            qkv_bias=attn_bias or mtype == "qwen2",
            o_bias=attn_bias and mtype in ("llama", "qwen3"),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and mtype == "llama",
            sliding_window=cfg.get("sliding_window") if mtype == "mistral" else None,
            qk_norm=mtype == "qwen3",
            arch=moe_type or mtype,
            **(_moe_fields(cfg, moe_type, need("num_hidden_layers")) if moe_type else {}),
        )
    if mtype == "gpt2":
        hidden = need("n_embd", "hidden_size")
        return ModelShape(
            name=name,
            layers=need("n_layer", "num_hidden_layers"),
            hidden=hidden,
            heads=need("n_head", "num_attention_heads"),
            kv_heads=need("n_head", "num_attention_heads"),
            ffn_hidden=cfg.get("n_inner") or 4 * hidden,
            vocab=need("vocab_size"),
            max_seq=need("n_positions", "max_position_embeddings"),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            gated_mlp=False,
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            arch="gpt2",
        )
    supported = ", ".join((*LLAMA_TYPES, *GEMMA3_TYPES))
    raise ValueError(
        f"model_type: unsupported {mtype!r}; supported: {supported}, gpt2 (and for planning: qwen3_moe, mixtral, deepseek_v3)"
    )


def shape_from_hf_config(path: str | Path, strict: bool = True) -> ModelShape:
    """A ModelShape from a config.json file (or a folder holding one); errors start with the file name."""
    p = config_path(path)
    cfg = read_config(p)
    # a model folder's config.json is named after the folder; a loose `qwen3-8b.json` after its own stem
    name = str(cfg.get("_name_or_path") or (p.parent.name if p.name == "config.json" else p.stem) or p.stem)
    try:
        return shape_from_config(cfg, name, strict)
    except ValueError as err:
        raise HFConfigError(f"{p}: {err}") from None


def _rope_entry(theta: float, scaling: RopeScaling | None) -> dict:
    """One `rope_parameters` object as transformers 5 writes it."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    rope = {"rope_type": scaling.kind, "rope_theta": theta, "factor": scaling.factor}
    if scaling.kind == "llama3":
        rope.update(
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    return rope


def _gemma3_export(shape: ModelShape) -> dict:
    """The gemma3_text fields of an export written from the shape (what Gemma3TextConfig reads)."""
    scalar = shape.query_pre_attn_scalar or shape.head_dim
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": shape.o_bias,
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,  # Gemma3TextConfig: an int
        "sliding_window": shape.sliding_window,
        "layer_types": list(shape.layer_types),
        "rope_parameters": {
            "full_attention": _rope_entry(shape.rope_theta, shape.rope_scaling),
            "sliding_attention": _rope_entry(shape.rope_local_theta or shape.rope_theta, None),
        },
        "final_logit_softcapping": shape.final_logit_softcap,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def _text_decoder_config(source: dict) -> dict:
    """A gemma3 image-text config's text decoder as a gemma3_text config (the export holds the decoder only)."""
    cfg = {k: v for k, v in source.items() if k in ("tie_word_embeddings", "bos_token_id", "eos_token_id")}
    cfg |= dict(source.get("text_config") or {})
    cfg |= {
        "model_type": "gemma3_text",
        "architectures": [ARCHITECTURES["gemma3_text"]],
        "tie_word_embeddings": bool(source.get("tie_word_embeddings", True)),  # the image-text model's flag
    }
    return cfg


def config_for_export(shape: ModelShape, source: dict | None, dtype: str) -> dict:
    """The config.json of an export: the source config when the run started from one (dtype updated; a gemma3
    image-text source gives its text_config as gemma3_text), else a config of the shape's family written from
    the shape (what transformers' LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config or Gemma3TextConfig
    reads)."""
    if source is not None and source.get("model_type") == "gemma3":
        cfg = _text_decoder_config(source)
    elif source is not None:
        cfg = dict(source)
        cfg.setdefault("architectures", [ARCHITECTURES.get(cfg.get("model_type"), "LlamaForCausalLM")])
    else:
        if shape.arch not in ARCHITECTURES:
            raise ValueError(f"model {shape.name}: export needs a llama-style model, got {shape.arch!r}")
        cfg = {
            "architectures": [ARCHITECTURES[shape.arch]],
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
            "rope_parameters": _rope_entry(shape.rope_theta, shape.rope_scaling),
        }
        if shape.arch == "qwen3":  # attention_bias covers q/k/v and o alike; no mlp_bias in Qwen3Config
            cfg |= {"attention_bias": shape.qkv_bias, "use_sliding_window": False}
            del cfg["mlp_bias"]
        if shape.arch == "mistral":
            cfg["sliding_window"] = shape.sliding_window
        if shape.arch == "gemma3_text":
            del cfg["hidden_act"], cfg["mlp_bias"]
            cfg |= _gemma3_export(shape)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    return cfg
