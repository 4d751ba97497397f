"""Mixture-of-experts shapes: the catalog's totals and activated parameters against the published figures, the
qwen3_moe / mixtral / deepseek_v3 config readers against transformers' own models, FLOPs from activated parameters,
and the trainers' refusal of MoE models by name."""

from __future__ import annotations

import json

import pytest
import yaml

from nightloom.catalog import MODELS
from nightloom.hf.config import shape_from_config, shape_from_hf_config
from nightloom.perf import active_params, count_params, expert_params, flops_per_token
from nightloom.spec.load import load_spec

MOE = ["mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3"]


@pytest.mark.parametrize("name", MOE)
def test_catalog_totals_and_actives_equal_the_published_figures(name):
    """Totals within 1%. Activated counts within 1%, except where the card prints two significant digits and
    truncates (Qwen3-30B-A3B "3.3B" for 3.35e9, DeepSeek-V3 "37B" for 37.55e9): there within that last digit."""
    s = MODELS[name]
    total, active = count_params(s), active_params(s)
    assert abs(total / s.published_params - 1) < 0.01, (total, s.published_params)
    pub = s.published_active_params
    digit = 10 ** (len(str(int(pub / 1e8))) - 2) * 1e8  # one unit of the printed second significant digit
    assert abs(active / pub - 1) < 0.01 or pub <= active < pub + digit, (active, pub)
    assert active < total and expert_params(s) < total


def test_dense_models_are_unchanged():
    """A dense shape has no experts: active = total, and its FLOPs are PaLM's 6N + 12·L·H·Q·T."""
    s = MODELS["llama3-8b"]
    assert active_params(s) == count_params(s) and expert_params(s) == 0
    n = count_params(s, include_embeddings=False)
    assert flops_per_token(s, 4096) == 6 * n + 12 * s.layers * s.heads * s.head_dim * 4096


def test_moe_flops_follow_activated_parameters():
    s = MODELS["mixtral-8x7b"]
    n_active = active_params(s, include_embeddings=False)
    assert flops_per_token(s, 4096) == 6 * n_active + 12 * s.layers * s.heads * s.head_dim * 4096
    # top-2 of 8 experts: about 3.6× fewer FLOPs than the total parameters would say
    assert 3 < count_params(s, include_embeddings=False) / n_active < 4


def _tiny(model_type: str, **kw) -> dict:
    base = dict(
        model_type=model_type,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return base | kw


CASES = {
    "qwen3_moe": _tiny(
        "qwen3_moe",
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        norm_topk_prob=True,
    ),
    "qwen3_moe_step": _tiny(
        "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=2
    ),
    "mixtral": _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": _tiny(
        "deepseek_v3",
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_config_reader_counts_what_transformers_builds(case):
    """The parsed shape's parameter count equals the parameters of transformers' own model of that config (its
    experts, routers, dense layers, MLA projections and norms)."""
    transformers = pytest.importorskip("transformers")
    cfg = CASES[case]
    shape = shape_from_config(cfg, case, strict=False)
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    n = sum(p.numel() for p in model.parameters())
    assert count_params(shape) == n, (case, count_params(shape), n)
    if case == "qwen3_moe":
        assert shape.dense_layers == (0,) and shape.moe_layers == 3 and shape.norm_topk_prob
    if case == "qwen3_moe_step":
        assert shape.dense_layers == (0, 2)  # (i + 1) % decoder_sparse_step != 0
    if case == "deepseek_v3":
        assert shape.dense_layers == (0,) and shape.shared_experts == 1


def test_transformers5_spelling_of_qwen3_moe_experts(tmp_path):
    """transformers 5.24's save_pretrained writes num_local_experts (num_experts null); the Hub's num_experts."""
    cfg = CASES["qwen3_moe"] | {"num_experts": None, "num_local_experts": 6}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert shape_from_hf_config(p).num_experts == 6
    with pytest.raises(ValueError, match="mlp_only_layers"):
        shape_from_config(CASES["qwen3_moe"] | {"mlp_only_layers": [9]})


@pytest.mark.parametrize("model", [{"name": "deepseek-v3"}, {"config": "moe/config.json"}])
def test_deepseek_v3_specs_load_by_name_and_by_config(tmp_path, model):
    """deepseek_v3 trains natively now (tests/unit/train/test_moe.py: parity with transformers): a spec naming the
    catalog's DeepSeek-V3 or a deepseek_v3 config.json loads, and its shape carries the sigmoid router's groups."""
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(CASES["deepseek_v3"] | {"vocab_size": 512}))
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n')
    spec = {"name": "t", "dataset": {"path": "c.jsonl"}, "model": model}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_spec(path)
    shape = shape_from_hf_config(tmp_path / "moe" / "config.json") if "config" in model else MODELS["deepseek-v3"]
    assert loaded.model is not None and shape.router_score == "sigmoid" and shape.mla
    if "name" in model:
        assert (shape.router_groups, shape.router_topk_groups, shape.routed_scaling) == (8, 4, 2.5)
