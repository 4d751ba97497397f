"""Gemma 3 config.json -> ModelShape: transformers' own reading of the same configs (Gemma3TextConfig, and the
text_config of Gemma3Config) decides the fields; the catalog's Gemma 3 sizes are what their published config.json
files parse to; what the native model does not compute is refused by name; names, parameter counts and the FLOPs of
window-limited layers; context parallel refused with sliding windows; an image-text checkpoint's vision tower
refused by name; an image-text source config exports as gemma3_text."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from nightloom.catalog import MODELS
from nightloom.hf.config import HFConfigError, config_for_export, shape_from_config, shape_from_hf_config
from nightloom.hf.load import WeightsError, scan_checkpoint
from nightloom.hf.names import expected_shapes, to_hf
from nightloom.hf.random_model import build_random_model
from nightloom.parallel import ParallelDims
from nightloom.perf import count_params, flops_per_token
from nightloom.train.model import build_model, param_count

#: google/gemma-3-1b-pt's config.json as we know it (not downloaded here): a gemma3_text config, Hub form
#: (top-level rope_theta, rope_local_base_freq, sliding_window_pattern)
HUB_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
}
#: google/gemma-3-{4b,12b,27b}-pt: image-text configs whose text_config leaves out what Gemma3TextConfig defaults
HUB_TEXT = {
    "gemma3-4b": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34},
    "gemma3-12b": {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
    },
    "gemma3-27b": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
    },
}
#: the report's non-embedding parameters (Gemma 3 Technical Report, Table 1)
NON_EMBEDDING = {"gemma3-1b": 698e6, "gemma3-4b": 3209e6, "gemma3-12b": 10759e6, "gemma3-27b": 25600e6}


def _image_text(text: dict) -> dict:
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            "model_type": "gemma3_text",
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
            **text,
        },
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896},
        "mm_tokens_per_image": 256,
    }


def _hub(name: str) -> dict:
    return HUB_1B if name == "gemma3-1b" else _image_text(HUB_TEXT[name])


@pytest.mark.parametrize("name", sorted(NON_EMBEDDING))
def test_catalog_entry_is_its_hub_config(name):
    shape = shape_from_config(_hub(name), name)
    assert shape == MODELS[name].with_(published_params=None)
    assert (
        shape.arch == "gemma3_text"
        and shape.tied_embeddings
        and shape.layer_types.count("full_attention") == (shape.layers // 6)
    )
    assert abs(count_params(shape, include_embeddings=False) - NON_EMBEDDING[name]) <= 1e6, name


@pytest.mark.parametrize("name", sorted(NON_EMBEDDING))
def test_transformers_reads_the_same_fields(name, tmp_path):
    """Every field the shape takes from the config (defaults included) is what transformers' config holds."""
    (tmp_path / "config.json").write_text(json.dumps(_hub(name)))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    theirs = getattr(theirs, "text_config", theirs)
    ours = shape_from_hf_config(tmp_path)
    rope = theirs.rope_parameters
    assert (ours.layers, ours.hidden, ours.heads, ours.kv_heads, ours.head_dim, ours.ffn_hidden, ours.vocab) == (
        theirs.num_hidden_layers,
        theirs.hidden_size,
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
        theirs.head_dim,
        theirs.intermediate_size,
        theirs.vocab_size,
    )
    assert ours.max_seq == theirs.max_position_embeddings and ours.sliding_window == theirs.sliding_window
    assert list(ours.layer_types) == theirs.layer_types
    assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar and ours.norm_eps == theirs.rms_norm_eps
    assert ours.rope_theta == rope["full_attention"]["rope_theta"]
    assert ours.rope_local_theta == rope["sliding_attention"]["rope_theta"]
    scaling = rope["full_attention"]["rope_type"]
    assert (ours.rope_scaling.kind if ours.rope_scaling else "default") == scaling


BASE = {"model_type": "gemma3_text", **{k: HUB_1B[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}}


@pytest.mark.parametrize(
    "change,field",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
        ({"layer_types": ["chunked_attention"] * 26}, "layer_types"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, "rope_scaling.rope_type"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            },
            "rope_parameters.sliding_attention.rope_type",
        ),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_math_is_an_error_naming_the_field(tmp_path, change, field):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **change}))
    with pytest.raises(HFConfigError, match=rf"config.json: {field}"):
        shape_from_hf_config(tmp_path)


def test_image_text_fields_are_named_under_text_config(tmp_path):
    cfg = _image_text({**HUB_TEXT["gemma3-4b"], "attn_logit_softcapping": 30.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFConfigError, match=r"config.json: text_config.attn_logit_softcapping"):
        shape_from_hf_config(tmp_path)
    assert shape_from_hf_config(tmp_path, strict=False).layers == 34  # read for FLOPs (another trainer)


def test_names_counts_and_windowed_flops():
    shape = shape_from_config(
        {**BASE, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 96, "vocab_size": 100, "sliding_window": 8}
    )  # fmt: skip
    model = build_model(shape, 32)
    assert to_hf("layers.1.ffn_norm.weight", shape) == "model.layers.1.pre_feedforward_layernorm.weight"
    assert to_hf("layers.1.attn_post_norm.weight", shape) == "model.layers.1.post_attention_layernorm.weight"
    assert to_hf("layers.1.ffn_post_norm.weight", shape) == "model.layers.1.post_feedforward_layernorm.weight"
    assert to_hf("layers.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"  # llama's
    ours = {to_hf(n, shape): tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == expected_shapes(shape)  # tied: no lm_head
    assert count_params(shape) == param_count(model)
    assert count_params(shape) - count_params(shape.with_(post_norms=False)) == 6 * 2 * 64
    # five sliding layers see min(8, T) keys a query, the global one T (PaLM's 12·H·Q per key)
    per_key = 12 * shape.heads * shape.head_dim
    full = shape.with_(sliding_window=None, layer_types=())
    for seq in (4, 8, 32):
        assert flops_per_token(full, seq) - flops_per_token(shape, seq) == per_key * 5 * (seq - min(8, seq))
    assert shape.windowed(32) and not shape.windowed(8)


def test_context_parallel_refuses_sliding_windows():
    cp = ParallelDims(cp=2, dp_shard=1)
    gemma = MODELS["gemma3-1b"]
    assert any("sliding-window attention" in w for w in cp.check(gemma, 4096, None, device_type="cuda"))
    assert any("own RoPE base" in w for w in cp.check(gemma, 256, None, device_type="cuda"))  # window >= seq
    mistral = MODELS["llama2-7b"].with_(sliding_window=1024)
    assert any("sliding-window" in w for w in cp.check(mistral, 2048, None, device_type="cuda"))
    assert not any("sliding-window" in w for w in cp.check(mistral, 1024, None, device_type="cuda"))


def test_image_text_checkpoint_gives_its_text_decoder(tmp_path):
    """A gemma3 image-text folder: the shape is its text decoder; the weights' vision tower is left out, the
    decoder read from under `model.language_model.` (tests/unit/hf/test_gemma3_image_text.py: logits)."""
    from safetensors.torch import save_file

    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(_image_text(text)))
    shape = shape_from_hf_config(tmp_path)
    tensors = {
        ("model.language_model." + k[len("model.") :]): torch.zeros(v) for k, v in expected_shapes(shape).items()
    }
    tensors["model.vision_tower.vision_model.post_layernorm.weight"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    index = scan_checkpoint(tmp_path, shape)
    assert set(index.tensors) == set(expected_shapes(shape)) and list(index.left_out) == [
        "model.vision_tower.vision_model.post_layernorm.weight"
    ]
    assert index.stored_name("model.norm.weight") == "model.language_model.norm.weight"
    assert "left out 1 tensors" in index.left_out_line() and "model.vision_tower.* (1)" in index.left_out_line()
    tensors["model.language_model.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"tensor model\.language_model\.extra\.weight: unexpected"):
        scan_checkpoint(tmp_path, shape)


def test_image_text_final_logit_capping_is_refused(tmp_path):
    """transformers' Gemma3ForConditionalGeneration leaves the final capping out, its Gemma3ForCausalLM applies it:
    the source and the text-only export would not score the same."""
    (tmp_path / "config.json").write_text(
        json.dumps(_image_text({**HUB_TEXT["gemma3-4b"], "final_logit_softcapping": 30.0}))
    )
    with pytest.raises(HFConfigError, match=r"text_config.final_logit_softcapping: 30.0 is not supported"):
        shape_from_hf_config(tmp_path)


def test_image_text_head_is_tied_by_the_top_level_flag():
    """Gemma3Config's own tie_word_embeddings (default true) ties the head; transformers writes text_config's
    flag as true even for an untied model."""
    untied = {**_image_text({**HUB_TEXT["gemma3-4b"], "tie_word_embeddings": True}), "tie_word_embeddings": False}
    assert not shape_from_config(untied).tied_embeddings
    assert not config_for_export(shape_from_config(untied), untied, "bf16")["tie_word_embeddings"]
    tied = _image_text({**HUB_TEXT["gemma3-4b"], "tie_word_embeddings": False})  # no top-level flag: true
    assert shape_from_config(tied).tied_embeddings
    assert config_for_export(shape_from_config(tied), tied, "bf16")["tie_word_embeddings"]


def test_image_text_source_exports_its_text_decoder():
    cfg = config_for_export(MODELS["gemma3-4b"], _image_text(HUB_TEXT["gemma3-4b"]), "bf16")
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert "vision_config" not in cfg and shape_from_config(cfg, "gemma3-4b") == MODELS["gemma3-4b"].with_(
        published_params=None
    )


def test_random_gemma3_norms_are_scales_around_one(tmp_path):
    """build_random_model's norm_std draws Gemma's (1 + w) weights around 0, so scales stay around 1."""
    folder = build_random_model(
        tmp_path / "g", "gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64, norm_std=0.3,
    )  # fmt: skip
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.0.post_feedforward_layernorm.weight")
    assert 0.05 < float(w.std()) < 1.0 and abs(float(w.mean())) < 0.3


def test_job_json_round_trip_keeps_the_gemma3_shape(tmp_path):
    """TrainJob carries the shape as it is: layer types come back as a tuple, every Gemma field kept."""
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    shape = MODELS["gemma3-27b"]
    job = TrainJob(run_id="r", run_dir=str(tmp_path), model=shape, plan=ParallelPlan(), train=TrainSpec(), manifest="m")
    again = TrainJob.model_validate_json(job.model_dump_json()).model
    assert again == shape and isinstance(again.layer_types, tuple) and again.query_pre_attn_scalar == 168.0


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_keeps_the_window(mode):
    """Selective and full recompute pass the sliding mask and the query scale through the checkpointed call:
    the same loss and gradients as without recompute."""
    shape = shape_from_config(
        {**BASE, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "intermediate_size": 48, "vocab_size": 50, "sliding_window": 4, "query_pre_attn_scalar": 7,
         "sliding_window_pattern": 2}
    )  # fmt: skip
    ids = torch.randint(0, 50, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = []
    for m in ("none", mode):
        model = build_model(shape, 16, device="cpu")
        model.init_weights(3)
        model.set_recompute(m)
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
