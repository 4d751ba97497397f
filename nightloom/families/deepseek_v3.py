"""deepseek_v3 (DeepSeek-V3, Moonlight, Kimi K2): multi-head latent attention, shared experts beside the routed
ones, a grouped sigmoid router. Its experts keep the Hub's per-expert layout on disk (nightloom/hf/names.py)."""

from __future__ import annotations

from nightloom.families.common import decoder_fields, need_field, rope_or_plain
from nightloom.families.registry import Family, register
from nightloom.shape import ModelShape

#: transformers 5.24's DeepseekV3Config class defaults for fields a deepseek_v3 config.json may leave out
DEFAULTS = {
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


def read(cfg: dict, name: str, strict: bool) -> ModelShape:
    """A deepseek_v3 config's shape (DeepSeek-V3, Moonlight, Kimi K2): multi-head latent attention, shared experts
    beside the routed ones, the first first_k_dense_replace layers dense, the sigmoid router grouped as
    transformers' DeepseekV3TopkRouter, YaRN RoPE scaling. strict: what the native model does not compute is refused
    by name (attention_bias, another activation, an older config's auxiliary-loss routing)."""
    cfg = {**cfg, **{k: v for k, v in DEFAULTS.items() if k not in cfg}}  # absent only: null is a value here

    def need(*keys: str) -> int:
        return need_field(cfg, *keys)

    layers = need("num_hidden_layers")
    freq = cfg.get("moe_layer_freq", 1) or 1
    first = cfg.get("first_k_dense_replace") or 0
    nope, rope = need("qk_nope_head_dim"), need("qk_rope_head_dim")
    theta, scaling = rope_or_plain(cfg, strict)
    if strict:
        if cfg.get("attention_bias"):
            raise ValueError("attention_bias: true is not supported for deepseek_v3")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: {cfg['hidden_act']!r} is not supported (silu)")
        for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            if cfg.get(key) not in (None, want):
                raise ValueError(f"{key}: {cfg[key]!r} is not supported (transformers' deepseek_v3 runs {want})")
    fields = decoder_fields(cfg)
    return ModelShape(
        name=name,
        **fields | {"kv_heads": fields["heads"]},  # latent attention: every head its own keys and values
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


register(
    Family(
        name="deepseek_v3",
        model_types=("deepseek_v3",),
        read=read,
        hf_classes=("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        expert_block=("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
        moe=True,
        xtuner_added="4.53",
    )
)
