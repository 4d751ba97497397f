"""The mixture-of-experts families on llama-style attention: qwen3_moe (qwen3's attention) and mixtral
(mistral's). Their experts keep the Hub's per-expert layout on disk (nightloom/hf/names.py)."""

from __future__ import annotations

from nightloom.families.common import with_defaults
from nightloom.families.dense import MISTRAL, QWEN3, Dense, dense_shape
from nightloom.families.registry import Family, register
from nightloom.shape import ModelShape

#: transformers 5.24's class defaults (Qwen3MoeConfig, MixtralConfig) for fields a config.json leaves out
QWEN3_MOE_DEFAULTS = {
    "num_key_value_heads": 4,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
}
MIXTRAL_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}


def experts(cfg: dict, *keys: str) -> int:
    """The routed expert count: the first of `keys` set (qwen3_moe Hub configs say num_experts; transformers 5.24
    writes num_local_experts with num_experts null)."""
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{k}: expected a positive integer, got {v!r}")
            return v
    return 128  # Qwen3MoeConfig's default (mixtral's key has its default filled in)


def _fields(cfg: dict, num_experts: int, ffn: int, norm: bool, dense: tuple[int, ...]) -> dict:
    return {
        "num_experts": num_experts,
        "experts_per_token": cfg["num_experts_per_tok"],
        "expert_ffn_hidden": ffn,
        "dense_layers": dense,
        "norm_topk_prob": norm,
        "router_aux_loss_coef": float(cfg["router_aux_loss_coef"]),
    }


def qwen3_moe_fields(cfg: dict, layers: int) -> dict:
    """A layer is dense when it is listed in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (transformers'
    Qwen3MoeDecoderLayer)."""
    only, step = cfg.get("mlp_only_layers") or [], cfg["decoder_sparse_step"]
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step: expected a positive integer, got {step!r}")
    bad = [i for i in only if not isinstance(i, int) or not 0 <= i < layers]
    if bad:
        raise ValueError(f"mlp_only_layers: {bad} outside 0..{layers - 1}")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    n = experts(cfg, "num_experts", "num_local_experts")
    return _fields(cfg, n, cfg["moe_intermediate_size"], bool(cfg["norm_topk_prob"]), dense)


def mixtral_fields(cfg: dict, layers: int) -> dict:
    """Every layer sparse, experts of intermediate_size, the top-2 weights always renormalised."""
    return _fields(cfg, experts(cfg, "num_local_experts", "num_experts"), cfg["intermediate_size"], True, ())


def moe_family(model_type: str, attention: Dense, defaults: dict, fields, **kw) -> Family:
    """The registered unit of a mixture-of-experts family on `attention`'s llama-style attention."""

    def read(cfg: dict, name: str, strict: bool) -> ModelShape:
        # the defaults fill no field the attention's refusals read
        return dense_shape(with_defaults(cfg, defaults), name, strict, attention, arch=model_type, moe=fields)

    return Family(name=model_type, model_types=(model_type,), read=read, moe=True, **kw)


register(
    moe_family(
        "qwen3_moe",
        QWEN3,
        QWEN3_MOE_DEFAULTS,
        qwen3_moe_fields,
        hf_classes=("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        expert_block=("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
        xtuner_added="4.51",
    )
)
register(
    moe_family(
        "mixtral",
        MISTRAL,
        MIXTRAL_DEFAULTS,
        mixtral_fields,
        hf_classes=("MixtralConfig", "MixtralForCausalLM"),
        expert_block=("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
    )
)
