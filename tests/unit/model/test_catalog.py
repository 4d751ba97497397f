"""Catalog facts: parameter counts against published figures, GPU entries with sources, HF config.json shapes."""

from __future__ import annotations

import json
import math

import pytest

from nightloom.catalog import GPUS, MODELS, get_gpu
from nightloom.hf.config import shape_from_hf_config
from nightloom.model_resolver import shape_from_name_or_config as resolve_model
from nightloom.perf import count_params

PUBLISHED = [m for m in MODELS.values() if m.published_params]


@pytest.mark.parametrize("shape", PUBLISHED, ids=lambda m: m.name)
def test_param_counts_match_published(shape):
    n, pub = count_params(shape), shape.published_params
    # PTD-P prints sizes to 3-4 significant digits (1.7B for 1.65e9): allow half a unit of the last digit too
    digits = 3 if pub < 1e10 else 4 if pub < 1e11 else 5
    half_ulp = 0.5 * 10 ** (math.floor(math.log10(pub)) - (digits - 2)) if shape.name.startswith("gpt-") else 0.0
    if shape.name.startswith("mcore-"):  # Megatron-Core's table prints 1.7B, 7.1B, 16B ... 462B: 0.1B or 1B units
        half_ulp = 0.05e9 if pub < 1e10 else 0.5e9
    if shape.name.startswith("qwen3-"):  # the Qwen3 model cards print 0.6B, 1.7B, 4.0B, ... 32.8B: 0.1B units
        half_ulp = 0.05e9
    assert abs(n - pub) <= 0.01 * pub + half_ulp, (shape.name, n, pub)


def test_llama_counts_within_one_percent():
    for name in ("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b"):
        m = MODELS[name]
        assert abs(count_params(m) / m.published_params - 1) < 0.01, name


def test_llama32_counts_tied_and_long_rope():
    """Llama 3.2 1B/3B: the model card's 1.23B and 3.21B (printed to 0.01B) count the tied matrix once."""
    for name, exact in (("llama3.2-1b", 1_235_814_400), ("llama3.2-3b", 3_212_749_824)):
        m = MODELS[name]
        assert count_params(m) == exact and abs(exact - m.published_params) <= 0.006e9, name
        assert m.tied_embeddings and count_params(m.with_(tied_embeddings=False)) == exact + 128256 * m.hidden
        assert (m.rope_theta, m.rope_scaling.kind, m.rope_scaling.factor, m.max_seq) == (5e5, "llama3", 32.0, 131072)


REQUIRED_GPUS = [
    "a100-40gb",
    "a100-80gb",
    "a800-80gb",
    "h100-80gb",
    "h800",
    "h200",
    "h20",
    "l40s",
    "rtx-4090",
    "ascend-910b",
]


@pytest.mark.parametrize("name", REQUIRED_GPUS)
def test_gpu_entries_have_facts_and_source(name):
    g = GPUS[name]
    assert g.peak_flops_bf16 > g.peak_flops_fp32 > 0
    assert g.memory_gib > 0 and g.hbm_bw > 0 and g.intra_node_bw > 0 and g.inter_node_bw > 0
    assert len(g.source) > 20 and any(w in g.source for w in ("datasheet", "brief", "whitepaper", "quoted"))


def test_gpu_aliases_and_unknown():
    assert get_gpu("H100").name == "h100-80gb" and get_gpu("910b").name == "ascend-910b"
    with pytest.raises(KeyError, match="unknown GPU type 'tpu-v9'"):
        get_gpu("tpu-v9")


def _write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


def test_llama_config_json_matches_catalog(tmp_path):
    cfg = {
        "model_type": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    shape = shape_from_hf_config(_write(tmp_path, cfg))
    assert count_params(shape) == count_params(MODELS["llama2-70b"])
    assert resolve_model(str(tmp_path)).hidden == 8192  # a folder holding config.json works too


def test_qwen2_and_mistral_configs(tmp_path):
    for mt in ("qwen2", "mistral"):
        cfg = {
            "model_type": mt,
            "hidden_size": 896,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
        }
        s = shape_from_hf_config(_write(tmp_path, cfg, f"{mt}.json"))
        assert (s.kv_heads, s.tied_embeddings, s.gated_mlp) == (2, True, True)


def test_gpt2_config_matches_ptdp_shape(tmp_path):
    cfg = {"model_type": "gpt2", "n_layer": 24, "n_embd": 2304, "n_head": 24, "vocab_size": 51200, "n_positions": 2048}
    s = shape_from_hf_config(_write(tmp_path, cfg))
    assert (s.ffn_hidden, s.gated_mlp, s.kv_heads) == (4 * 2304, False, 24)
    assert count_params(s) == count_params(MODELS["gpt-1.7b"])


def test_config_errors_name_file_and_field(tmp_path):
    bad = _write(
        tmp_path,
        {
            "model_type": "llama",
            "hidden_size": 1000,
            "num_hidden_layers": 2,
            "num_attention_heads": 3,
            "intermediate_size": 10,
            "vocab_size": 10,
            "max_position_embeddings": 8,
        },
    )
    with pytest.raises(ValueError, match=r"config.json: .*hidden \(1000\) is not divisible by heads \(3\)"):
        shape_from_hf_config(bad)
    missing = _write(tmp_path, {"model_type": "gpt2", "n_layer": 2, "n_head": 2}, "m.json")
    with pytest.raises(ValueError, match=r"m.json: n_embd or hidden_size: required"):
        shape_from_hf_config(missing)
    other = _write(tmp_path, {"model_type": "t5"}, "t5.json")
    with pytest.raises(ValueError, match=r"t5.json: model_type: unsupported 't5'"):
        shape_from_hf_config(other)
    (tmp_path / "broken.json").write_text('{\n  "a": ,\n}')
    with pytest.raises(ValueError, match=r"broken.json:2: invalid JSON"):
        shape_from_hf_config(tmp_path / "broken.json")


def test_a_loose_config_file_is_named_after_its_stem_a_model_folder_after_itself(tmp_path):
    """`plan --model models/qwen-tiny.json` says "qwen-tiny", not "models"; config.json in a folder keeps the folder's
    name, and the config's own `_name_or_path` wins over both."""
    cfg = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128,
    }  # fmt: skip
    models = tmp_path / "models"
    models.mkdir()
    assert resolve_model(_write(models, cfg, "qwen-tiny.json")).name == "qwen-tiny"
    folder = tmp_path / "llama-mini"
    folder.mkdir()
    assert resolve_model(_write(folder, cfg)).name == "llama-mini"
    assert resolve_model(str(folder)).name == "llama-mini"
    assert resolve_model(_write(models, {**cfg, "_name_or_path": "org/named"}, "x.json")).name == "org/named"
