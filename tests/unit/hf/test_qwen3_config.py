"""Qwen3 config.json -> ModelShape: transformers' own reading of the same config (Qwen3Config) decides the fields,
the catalog's Qwen3 sizes are what their published config.json files parse to, and parameter counts include the
q/k norms (the native model's own count and the model cards' non-embedding figures)."""

from __future__ import annotations

import json

import pytest
import transformers

from nightloom.catalog import MODELS
from nightloom.hf.config import shape_from_config, shape_from_hf_config
from nightloom.hf.names import expected_shapes, to_hf
from nightloom.perf import count_params, flops_per_token
from nightloom.train.model import build_model, param_count

#: The Qwen/Qwen3-* config.json values on the Hugging Face Hub (shared by all sizes: head_dim 128, 8 kv heads,
#: vocab 151,936, max_position_embeddings 40,960, rope_theta 1e6, rms_norm_eps 1e-6, no bias, no sliding window)
#: and the model cards' "Number of Parameters (Non-Embedding)", printed to 0.01B / 0.1B.
HUB = {
    # name: (num_hidden_layers, hidden_size, num_attention_heads, intermediate_size, tie_word_embeddings, non-emb)
    "qwen3-0.6b": (28, 1024, 16, 3072, True, 0.44e9),
    "qwen3-1.7b": (28, 2048, 16, 6144, True, 1.4e9),
    "qwen3-4b": (36, 2560, 32, 9728, True, 3.6e9),
    "qwen3-8b": (36, 4096, 32, 12288, False, 6.95e9),
    "qwen3-14b": (40, 5120, 40, 17408, False, 13.2e9),
    "qwen3-32b": (64, 5120, 64, 25600, False, 31.2e9),
}


def _hub_config(layers, hidden, heads, ffn, tied) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


@pytest.mark.parametrize("name", sorted(HUB))
def test_catalog_entry_is_its_hub_config(name):
    *arch, non_emb = HUB[name]
    shape = shape_from_config(_hub_config(*arch), name)
    assert shape == MODELS[name].with_(published_params=None)
    assert shape.qk_norm and shape.head_dim == 128 and shape.arch == "qwen3" and not shape.qkv_bias
    # the model card prints 0.44B / 1.4B / 3.6B / 6.95B / 13.2B / 31.2B: within half of its last digit
    half_ulp = 0.005e9 if non_emb < 1e9 or name == "qwen3-8b" else 0.05e9
    assert abs(count_params(shape, include_embeddings=False) - non_emb) <= half_ulp, name


def test_fields_left_out_take_transformers_defaults(tmp_path):
    """head_dim and num_key_value_heads missing: Qwen3Config's class defaults (128, 32), not the Llama rule."""
    cfg = {
        "model_type": "qwen3",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = shape_from_hf_config(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (ours.head_dim, ours.kv_heads) == (theirs.head_dim, theirs.num_key_value_heads) == (128, 32)
    assert ours.norm_eps == theirs.rms_norm_eps and ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.tied_embeddings == theirs.tie_word_embeddings is False
    assert not ours.qkv_bias and not ours.o_bias


def test_attention_bias_covers_q_k_v_and_o(tmp_path):
    cfg = {
        **_hub_config(2, 64, 4, 128, False),
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 100,
        "attention_bias": True,
    }
    shape = shape_from_config(cfg)
    assert shape.qkv_bias and shape.o_bias and not shape.mlp_bias
    names = set(expected_shapes(shape))
    assert {"model.layers.1.self_attn.o_proj.bias", "model.layers.1.self_attn.q_proj.bias"} <= names


def test_q_k_norm_names_and_counts():
    shape = shape_from_config(
        {**_hub_config(2, 64, 4, 128, True), "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 100}
    )
    model = build_model(shape, 16)
    assert to_hf("layers.1.attn.q_norm.weight") == "model.layers.1.self_attn.q_norm.weight"
    assert to_hf("layers.0.attn.k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    ours = {to_hf(n): tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == expected_shapes(shape)  # tied: no lm_head
    assert ours["model.layers.0.self_attn.q_norm.weight"] == (24,)
    assert count_params(shape) == param_count(model)
    plain = shape.with_(qk_norm=False)
    assert count_params(shape) - count_params(plain) == 2 * 2 * 24  # two norms of head_dim per layer
    assert flops_per_token(shape, 16) - flops_per_token(plain, 16) == 6 * 2 * 2 * 24  # through 6·N only
