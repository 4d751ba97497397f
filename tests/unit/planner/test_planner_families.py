"""The planner on today's dense families: a Llama 3.2-style tied model gets TP and PP layouts for nightloom's own
trainer, qwen3's q/k norms count in activation memory, and per-layer parameters follow head_dim (issue 38)."""

from __future__ import annotations

import json

import pytest

from nightloom.catalog import MODELS
from nightloom.hf.config import shape_from_hf_config
from nightloom.parallel import ParallelDims
from nightloom.perf import count_params
from nightloom.planner import plan, plan_for_spec
from nightloom.planner.activations import activation_bytes_per_layer, post_norm_bytes, qk_norm_bytes
from nightloom.planner.memory import GIB, memory_breakdown, stage_params
from nightloom.spec.load import parse_spec

#: a small config in the form of meta-llama/Llama-3.2-1B's config.json (tied, llama3 RoPE scaling factor 32)
LLAMA32_STYLE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def test_llama32_style_tied_config_plans_tp2_and_pp2_for_the_native_trainer(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA32_STYLE))
    shape = shape_from_hf_config(path)
    assert shape.tied_embeddings and shape.rope_theta == 500000.0
    assert (shape.rope_scaling.kind, shape.rope_scaling.factor) == ("llama3", 32.0)
    for layout in ("tp=2,pp=1,dp=1", "tp=1,pp=2,dp=1"):
        r = plan(str(path), "h100", 1, 2, 1024, 8, layout=layout)  # native_trainer=True: the default
        c = r.chosen
        assert c.fits and (c.tp, c.pp) == ((2, 1) if layout.startswith("tp=2") else (1, 2)), c.explanation
        assert c.dims().check(shape, 1024, 8, native_trainer=True) == []
    # searched: nothing is refused for tying; TP2 and PP2 are scored (slower than FSDP for a model this small)
    r = plan(str(path), "h100", 1, 2, 1024, 8)
    assert not any("ties embeddings" in x.reason for x in r.rejected)
    assert {(a.tp, a.pp) for a in r.alternatives} >= {(2, 1), (1, 2)}
    assert {x.layout for x in r.rejected if x.reason.startswith("slower")} >= {"TP2·PP1·DP1", "TP1·PP2·DP1"}
    # the run's path: an explicit `parallel: {tp: 2}` section with that config as the model
    spec = parse_spec(
        {
            "name": "t",
            "dataset": {"path": "x", "sample": True},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "h100-80gb"},
            "model": {"config": str(path)},
            "train": {"seq_len": 1024, "global_batch": 8},
            "parallel": {"tp": 2, "dp_shard": 1},
        }
    )
    assert plan_for_spec(spec).chosen.tp == 2


def test_published_llama32_configs_give_the_catalog_entries(tmp_path):
    """meta-llama/Llama-3.2-1B and -3B config.json (the fields the shape reads) parse to the catalog's shapes."""
    for name, layers, hidden, heads, head_dim in (
        ("llama3.2-1b", 16, 2048, 32, 64),
        ("llama3.2-3b", 28, 3072, 24, 128),
    ):
        cfg = {**LLAMA32_STYLE, "hidden_size": hidden, "intermediate_size": 8192, "num_hidden_layers": layers}
        cfg |= {"num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": head_dim, "vocab_size": 128256}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        parsed = shape_from_hf_config(path)
        ours = MODELS[name]
        assert count_params(parsed) == count_params(ours), name
        assert (parsed.tied_embeddings, parsed.rope_scaling, parsed.max_seq, parsed.head_dim) == (
            ours.tied_embeddings,
            ours.rope_scaling,
            ours.max_seq,
            ours.head_dim,
        )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layer_params_add_up_to_the_parameter_count(name):
    """One process's parameters (tp=1, pp=1) are count_params's: q and o follow head_dim, q/k norms counted."""
    shape = MODELS[name]
    assert stage_params(shape, 1, 1)[0] == pytest.approx(count_params(shape), rel=1e-12)


def test_qwen3_8b_activation_memory_grows_by_the_qk_norm_inputs():
    shape = MODELS["qwen3-8b"]
    plain = shape.with_(qk_norm=False)
    s, b = 4096, 1
    # 2 bytes · s · b · (q_dim + kv_dim) per layer: q 32·128 and k 8·128 wide
    assert qk_norm_bytes(shape, s, b, 1) == 2 * s * b * (32 * 128 + 8 * 128)
    for t, sp, rc in ((1, False, "none"), (2, False, "none"), (4, True, "none"), (4, True, "selective")):
        grown = activation_bytes_per_layer(shape, s, b, t, sp, rc) - activation_bytes_per_layer(plain, s, b, t, sp, rc)
        assert grown == pytest.approx(2 * s * b * (32 + 8) * 128 / t), (t, sp, rc)
    assert activation_bytes_per_layer(shape, s, b, 4, True, "full") == activation_bytes_per_layer(
        plain, s, b, 4, True, "full"
    )  # full recompute keeps only the layer input
    # the whole rank: 36 layers × the micro-batches in flight (pp=1: one) more activation memory
    c = ParallelDims(tp=2, pp=1, dp_replicate=1, dp_shard=4, sp=True, micro_batch=b, grad_accum=8)
    delta = memory_breakdown(shape, c, s).activations_gib - memory_breakdown(plain, c, s).activations_gib
    assert delta * GIB == pytest.approx(36 * 2 * s * b * (32 + 8) * 128 / 2)


def test_gemma3_activation_memory_grows_by_the_post_norm_inputs():
    """Gemma 3's post-attention and post-feedforward norms save their inputs: 2 more 16-bit s·b·h tensors per
    layer (4·s·b·h bytes), replicated under TP alone, /t under SP, kept under selective recompute."""
    shape = MODELS["gemma3-27b"]
    plain = shape.with_(post_norms=False)
    s, b, h = 4096, 2, shape.hidden
    assert post_norm_bytes(plain, s, b, 1, False) == 0.0
    for t, sp, rc, want in (
        (1, False, "none", 4 * s * b * h),
        (2, False, "none", 4 * s * b * h),  # TP without SP: the norm inputs are whole on every TP rank
        (4, True, "none", 4 * s * b * h / 4),
        (4, True, "selective", 4 * s * b * h / 4),
        (2, False, "selective", 4 * s * b * h),
        (4, True, "full", 0.0),  # full recompute keeps only the layer input
    ):
        grown = activation_bytes_per_layer(shape, s, b, t, sp, rc) - activation_bytes_per_layer(plain, s, b, t, sp, rc)
        assert grown == pytest.approx(want), (t, sp, rc)
    c = ParallelDims(tp=2, pp=1, dp_replicate=1, dp_shard=4, sp=True, micro_batch=b, grad_accum=8)
    delta = memory_breakdown(shape, c, s).activations_gib - memory_breakdown(plain, c, s).activations_gib
    assert delta * GIB == pytest.approx(shape.layers * 4 * s * b * h / 2)
