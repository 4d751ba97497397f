"""config.json -> ModelShape: the one parser of Hugging Face model configs (planner, trainer, XTuner, export).

Every field of a llama, mistral, qwen2 or qwen3 config that changes the math is honoured or refused by name:
num_key_value_heads, head_dim, rope_theta and RoPE scaling in both spellings (transformers 4.x / the Hub's
top-level `rope_theta` + `rope_scaling`, transformers 5's `rope_parameters`), rms_norm_eps,
tie_word_embeddings, attention_bias / mlp_bias (qwen2 always has q/k/v bias), hidden_act, sliding windows.
qwen3 adds a per-head RMSNorm on q and k (`qk_norm`); where its config leaves a field out, transformers'
Qwen3Config default applies (head_dim 128, num_key_value_heads 32), as `from_pretrained` would read it.
gpt2 configs are read for planning only (their math is not the native model's).
"""

from __future__ import annotations

import json
from pathlib import Path

from nightloom.shape import ModelShape, RopeScaling

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
#: transformers' Qwen3Config class defaults for fields a config.json may leave out (not the Llama rule)
_QWEN3_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 32}
_ROPE_KINDS = ("default", "linear", "llama3")


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
    params = cfg.get(field) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{field}: expected an object, got {params!r}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
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


def shape_from_config(cfg: dict, name: str = "hf", strict: bool = True) -> ModelShape:
    """A ModelShape from a parsed config.json; raises ValueError naming the field.

    strict=False reads the shape only (FLOP counts for a model another trainer runs, e.g. XTuner): fields the
    native model cannot compute are then not refused and an unsupported RoPE scaling is left out."""
    mtype = cfg.get("model_type")

    def need(*keys: str) -> int:
        for k in keys:
            if cfg.get(k) is not None:
                v = cfg[k]
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ValueError(f"{k}: expected a positive integer, got {v!r}")
                return v
        raise ValueError(f"{' or '.join(keys)}: required for model_type {mtype!r} but missing")

    if mtype in LLAMA_TYPES:
        if strict:
            _refuse_unsupported(cfg, mtype)
        if mtype == "qwen3":
            cfg = {**cfg, **{k: v for k, v in _QWEN3_DEFAULTS.items() if cfg.get(k) is None}}
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = cfg.get("head_dim")
        try:
            theta, scaling = _rope(cfg)
        except ValueError:
            if strict:
                raise
            theta, scaling = float(cfg.get("rope_theta", 10000.0)), None
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
            arch=mtype,
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
    raise ValueError(f"model_type: unsupported {mtype!r}; supported: {', '.join(LLAMA_TYPES)}, gpt2")


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


def config_for_export(shape: ModelShape, source: dict | None, dtype: str) -> dict:
    """The config.json of an export: the source config when the run started from one (dtype updated),
    else a config of the shape's family written from the shape (what transformers' LlamaConfig, MistralConfig,
    Qwen2Config or Qwen3Config reads)."""
    if source is not None:
        cfg = dict(source)
        cfg.setdefault("architectures", [ARCHITECTURES.get(cfg.get("model_type"), "LlamaForCausalLM")])
    else:
        if shape.arch not in LLAMA_TYPES:
            raise ValueError(f"model {shape.name}: export needs a llama-style model, got {shape.arch!r}")
        rope: dict = {"rope_type": "default", "rope_theta": shape.rope_theta}
        if shape.rope_scaling is not None:
            s = shape.rope_scaling
            rope = {"rope_type": s.kind, "rope_theta": shape.rope_theta, "factor": s.factor}
            if s.kind == "llama3":
                rope.update(
                    low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings,
                )
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
            "rope_parameters": rope,
        }
        if shape.arch == "qwen3":  # attention_bias covers q/k/v and o alike; no mlp_bias in Qwen3Config
            cfg |= {"attention_bias": shape.qkv_bias, "use_sliding_window": False}
            del cfg["mlp_bias"]
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    return cfg
