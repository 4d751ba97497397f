"""gpt2: read for planning only (its math is not the native model's: learned positions, LayerNorm, GELU MLP)."""

from __future__ import annotations

from nightloom.families.common import need_field
from nightloom.families.registry import Family, register
from nightloom.shape import ModelShape


def read(cfg: dict, name: str, strict: bool) -> ModelShape:
    hidden = need_field(cfg, "n_embd", "hidden_size")
    return ModelShape(
        name=name,
        layers=need_field(cfg, "n_layer", "num_hidden_layers"),
        hidden=hidden,
        heads=need_field(cfg, "n_head", "num_attention_heads"),
        kv_heads=need_field(cfg, "n_head", "num_attention_heads"),
        ffn_hidden=cfg.get("n_inner") or 4 * hidden,
        vocab=need_field(cfg, "vocab_size"),
        max_seq=need_field(cfg, "n_positions", "max_position_embeddings"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        gated_mlp=False,
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        arch="gpt2",
    )


register(Family(name="gpt2", model_types=("gpt2",), read=read, trained=False))
