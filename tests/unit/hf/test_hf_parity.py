"""The native model against transformers (software we did not write) on Hugging Face checkpoints.

Seeded tiny llama / mistral / qwen2 / qwen3 / gemma3_text models, fp32, GQA, rope_theta != 1e4, llama3 and linear
RoPE scaling, initializer_range 0.25 so that a wrong RoPE layout or a skipped scaling moves the logits far beyond
1e-4 (notes/model-interop.md), saved with a small max_shard_size so the index and several files are used. Mistral
and Gemma 3 run with a sliding window shorter than the test sequence (Gemma: sliding and global layers, each with
its RoPE base; random (1 + w) norm weights). The negative controls (Q/K rows in the interleaved layout; RoPE scaling
ignored; qwen3's q or k norm skipped; a Gemma sliding window, local RoPE base, post-norm or embedding scale
ignored) must fail the same check."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from nightloom.hf.config import HFConfigError, shape_from_hf_config
from nightloom.hf.load import model_from_hf
from nightloom.hf.random_model import build_random_model

TOL = 1e-4
SEQ = 96
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
BASE = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.25,
}
CASES = {
    "llama-untied-llama3": ("llama", {"rope_theta": 50000.0, "rope_scaling": LLAMA3, "tie_word_embeddings": False}),
    "llama-tied-linear": (
        "llama",
        {"rope_theta": 20000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "tie_word_embeddings": True},
    ),
    "llama-bias-headdim": (
        "llama",
        {"rope_theta": 30000.0, "attention_bias": True, "mlp_bias": True, "head_dim": 24},
    ),
    "mistral": ("mistral", {"rope_theta": 1e6, "sliding_window": 128}),
    "mistral-window": ("mistral", {"rope_theta": 1e6, "sliding_window": 24}),  # < SEQ: every layer windowed
    "qwen2-bias": ("qwen2", {"rope_theta": 1e6, "tie_word_embeddings": True}),
    # qwen3: per-head q/k RMSNorm (weights randomised: NORM_STD), head_dim independent of hidden / heads
    "qwen3-untied": ("qwen3", {"rope_theta": 1e6, "head_dim": 24, "tie_word_embeddings": False}),
    # YaRN (Qwen3's long-context setting): ramped frequencies and cos/sin scaled by 0.1·ln(4) + 1
    "qwen3-yarn": (
        "qwen3",
        {
            "rope_theta": 1e6,
            "head_dim": 16,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        },
    ),
    "qwen3-tied-bias": (
        "qwen3",
        {"rope_theta": 1e6, "head_dim": 32, "tie_word_embeddings": True, "attention_bias": True},
    ),
    # gemma3: sliding layers (window 16 < SEQ, RoPE base 1e4) around a global one (base 1e6, linear x8), scores
    # scaled by query_pre_attn_scalar ** -0.5 != head_dim ** -0.5, final logits capped
    "gemma3-untied-window": (
        "gemma3_text",
        {
            "head_dim": 24,
            "tie_word_embeddings": False,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "query_pre_attn_scalar": 40,
            "final_logit_softcapping": 12.0,
        },
    ),
    # the Hub's older form: sliding_window_pattern instead of layer_types; tied, biased, no capping
    "gemma3-tied-bias-pattern": (
        "gemma3_text",
        {
            "head_dim": 16,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "sliding_window": 32,
            "sliding_window_pattern": 3,
            "rope_theta": 5e5,
            "rope_local_base_freq": 2e4,
            "query_pre_attn_scalar": 16,
        },
    ),
}
NORM_STD = 0.3  # RMSNorm weights 1 + N(0, 0.3): a norm weight left at 1 (not loaded) shows
NORMED = ("qwen3", "gemma3_text")  # families whose norm weights the tests randomise


def _hf_logits(folder, ids):
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids).logits


def _ours(folder, ids, model=None):
    model = model or model_from_hf(folder, SEQ)
    with torch.no_grad():
        return model.eval()(ids)


def _parity(a, b) -> tuple[float, bool]:
    return float((a - b).abs().max()), bool((a.argmax(-1) == b.argmax(-1)).all())


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, cfg = CASES[request.param]
    folder = build_random_model(
        tmp_path_factory.mktemp(request.param) / "hf",
        arch,
        seed=3,
        max_shard_size="100KB",
        bias_std=0.5,
        norm_std=NORM_STD if arch in NORMED else 0.0,  # the other families' models stay as they were
        **BASE,
        **cfg,
    )
    ids = torch.randint(0, BASE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(5))
    return request.param, folder, ids, _hf_logits(folder, ids)


def test_logits_match_transformers(case):
    name, folder, ids, ref = case
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    diff, same_argmax = _parity(ref, _ours(folder, ids))
    assert diff < TOL and same_argmax, f"{name}: max |logit diff| {diff:.2e} over {SEQ} positions"


def test_interleaved_qk_layout_fails_the_check(case):
    """Negative control: Q/K rows permuted to the interleaved (Meta) RoPE layout, as a loader that forgot the
    permutation between the two conventions would leave them."""
    name, folder, ids, ref = case
    model = model_from_hf(folder, SEQ)
    d = model.shape.head_dim
    perm = torch.arange(d).view(2, d // 2).t().reshape(-1)  # rotate-half rows -> interleaved pairs
    with torch.no_grad():
        for block in model.layers.values():
            for lin in (block.attn.wq, block.attn.wk):
                w = lin.weight.view(-1, d, lin.weight.shape[1])
                lin.weight.copy_(w[:, perm].reshape_as(lin.weight))
                if lin.bias is not None:
                    lin.bias.copy_(lin.bias.view(-1, d)[:, perm].reshape(-1))
    diff, _ = _parity(ref, _ours(folder, ids, model))
    assert diff > 100 * TOL, f"{name}: the wrong Q/K layout went unnoticed ({diff:.2e})"


@pytest.mark.parametrize("drop", ["q_norm", "k_norm"])
def test_skipping_a_qk_norm_fails_the_check(drop, tmp_path):
    """Negative control: qwen3 without its q (or k) norm, as a model that read the config as qwen2 would run."""
    arch, cfg = CASES["qwen3-untied"]
    folder = build_random_model(tmp_path / "hf", arch, seed=3, norm_std=NORM_STD, **BASE, **cfg)
    ids = torch.randint(0, 300, (1, SEQ), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(folder, ids)
    model = model_from_hf(folder, SEQ)
    assert _parity(ref, _ours(folder, ids, model))[0] < TOL
    for block in model.layers.values():
        setattr(block.attn, drop, None)
    diff, _ = _parity(ref, _ours(folder, ids, model))
    assert diff > 100 * TOL, f"{drop} skipped went unnoticed ({diff:.2e})"


def test_ignoring_rope_scaling_fails_the_check(tmp_path):
    arch, cfg = CASES["llama-untied-llama3"]
    folder = build_random_model(tmp_path / "hf", arch, seed=3, **BASE, **cfg)
    ids = torch.randint(0, 300, (1, SEQ), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(folder, ids)
    plain = json.loads((folder / "config.json").read_text())
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": plain["rope_parameters"]["rope_theta"]}
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    model = model_from_hf(folder, SEQ, config=tmp_path / "plain.json")
    diff, _ = _parity(ref, _ours(folder, ids, model))
    assert diff > 100 * TOL, diff
    assert _parity(ref, _ours(folder, ids))[0] < TOL


def test_hub_rope_scaling_form_equals_transformers5_form(tmp_path):
    """Llama 3.1 on the Hub: top-level rope_theta + rope_scaling; transformers 5 writes rope_parameters."""
    arch, cfg = CASES["llama-untied-llama3"]
    folder = build_random_model(tmp_path / "hf", arch, seed=3, **BASE, **cfg)
    new = json.loads((folder / "config.json").read_text())
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = new["rope_parameters"]["rope_theta"]
    old["rope_scaling"] = {k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"}
    (folder / "config.json").write_text(json.dumps(old))
    s_old = shape_from_hf_config(folder)
    (tmp_path / "new.json").write_text(json.dumps(new))
    s_new = shape_from_hf_config(tmp_path / "new.json")
    assert s_old.rope_scaling == s_new.rope_scaling and s_old.rope_scaling.kind == "llama3"
    assert s_old.rope_theta == s_new.rope_theta == 50000.0
    ids = torch.randint(0, 300, (1, SEQ), generator=torch.Generator().manual_seed(2))
    ref = _hf_logits(folder, ids)  # transformers reads the old form too
    assert _parity(ref, _ours(folder, ids))[0] < TOL


@pytest.mark.parametrize(
    "change,field",
    [
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters.rope_type"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "rope_parameters.original_max_position_embeddings",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        # qwen3: its sliding-window switch is named even though it also sets layer_types (as transformers saves it)
        (
            {
                "model_type": "qwen3",
                "use_sliding_window": True,
                "sliding_window": 64,
                "max_window_layers": 1,
                "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
            },
            "use_sliding_window",
        ),
        ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        (
            {
                "model_type": "qwen3",
                "rope_scaling": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 32768},
            },
            "rope_scaling.rope_type",
        ),
        ({"model_type": "qwen3", "hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "qwen3", "attention_dropout": 0.1}, "attention_dropout"),
        ({"model_type": "qwen3", "quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_unsupported_math_is_an_error_naming_the_field(tmp_path, change, field):
    cfg = {"model_type": "llama", **BASE, **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFConfigError, match=rf"config.json: {field}"):
        shape_from_hf_config(tmp_path)


def test_windowed_cases_are_windowed(case):
    """The sliding cases' windows are shorter than the sequence, so the mask is really used."""
    name, folder, _, _ = case
    shape = shape_from_hf_config(folder)
    assert shape.windowed(SEQ) == name.startswith(("gemma3", "mistral-window")), name


def _gemma3_case(tmp_path):
    arch, cfg = CASES["gemma3-untied-window"]
    folder = build_random_model(tmp_path / "hf", arch, seed=3, norm_std=NORM_STD, **BASE, **cfg)
    ids = torch.randint(0, 300, (1, SEQ), generator=torch.Generator().manual_seed(1))
    return folder, ids, _hf_logits(folder, ids)


def _no_window(model):
    for block in model.layers.values():
        block.attn.window = None


def _no_local_rope(model):
    model.rope_local_cos, model.rope_local_sin = model.rope_cos, model.rope_sin


def _no_post_norms(model):
    for block in model.layers.values():
        block.attn_post_norm = block.ffn_post_norm = None


def _no_embed_scale(model):
    model.shape = model.shape.with_(embed_scale=False)


def _plain_norms(model):
    for m in model.modules():
        if hasattr(m, "offset"):
            m.offset = 0.0


@pytest.mark.parametrize("damage", [_no_window, _no_local_rope, _no_post_norms, _no_embed_scale, _plain_norms])
def test_skipping_a_gemma3_part_fails_the_check(damage, tmp_path):
    """Negative controls: each Gemma 3 part the native model adds, left out, moves the logits past the tolerance."""
    folder, ids, ref = _gemma3_case(tmp_path)
    model = model_from_hf(folder, SEQ)
    assert _parity(ref, _ours(folder, ids, model))[0] < TOL
    damage(model)
    diff, _ = _parity(ref, _ours(folder, ids, model))
    assert diff > 100 * TOL, f"{damage.__name__} went unnoticed ({diff:.2e})"


def test_gemma3_bf16_embedding_scale_is_rounded_as_transformers_does(tmp_path):
    """In bf16 sqrt(hidden) is rounded to the embedding dtype before the multiply (hidden 3072: 55.5, not 55.43)."""
    from nightloom.train.model import build_model

    shape = shape_from_hf_config(_gemma3_case(tmp_path)[0]).with_(hidden=3072)
    model = build_model(shape, 8, device="meta")
    assert model._embed_scales[torch.bfloat16] == 55.5 and abs(model._embed_scales[torch.float32] - 3072**0.5) < 1e-5
