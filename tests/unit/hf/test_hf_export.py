"""Hugging Face -> nightloom -> export: every tensor bit-identical, and transformers loads the export with
nothing missing or unexpected; bad weight folders are errors naming the file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nightloom.hf.config import shape_from_hf_config
from nightloom.hf.export import export_checkpoint
from nightloom.hf.load import WeightsError, model_from_hf, scan_checkpoint
from nightloom.hf.random_model import build_random_model

SMALL = {
    "vocab_size": 301,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.25,
}


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as s:
            out |= {k: s.get_tensor(k) for k in s.keys()}
    return out


#: gemma3: sliding and global layers, (1 + w) norm weights around 0 (random), query_pre_attn_scalar != head_dim
GEMMA3 = {
    "head_dim": 24,
    "norm_std": 0.3,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "query_pre_attn_scalar": 32,
}


@pytest.fixture(params=["llama", "qwen2-tied", "qwen3", "qwen3-tied", "gemma3", "gemma3-tied"])
def source(request, tmp_path):
    arch = request.param.split("-")[0]
    tied = request.param.endswith("tied")
    extra = {"head_dim": 24, "norm_std": 0.3} if arch == "qwen3" else {}  # q/k norm weights that are not all 1
    if arch == "gemma3":
        arch, extra = "gemma3_text", GEMMA3
    return build_random_model(
        tmp_path / "src", arch, seed=1, max_shard_size="60KB", bias_std=0.3, tie_word_embeddings=tied, **SMALL, **extra
    )


def _save_native(model, tmp_path):
    ckpt = tmp_path / "ckpt" / "step-0"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(ckpt), no_dist=True)
    return ckpt


def test_round_trip_is_bit_identical_and_loads_in_transformers(source, tmp_path):
    model = model_from_hf(source, 32)
    shutil.copyfile(source / "config.json", tmp_path / "tokenizer_config.json")  # any file named like a tokenizer's
    out = export_checkpoint(
        _save_native(model, tmp_path),
        model.shape,
        tmp_path / "export",
        dtype="fp32",
        source_config=source,
        tokenizer=tmp_path,
    )
    a, b = _tensors(source), _tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(b) and (out / "tokenizer_config.json").is_file()
    assert not list(tmp_path.glob(".export.tmp"))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not v for v in info.values()), info


def test_bf16_export_is_the_rounded_weights(source, tmp_path):
    model = model_from_hf(source, 32)
    out = export_checkpoint(_save_native(model, tmp_path), model.shape, tmp_path / "x", "bf16", source_config=source)
    a, b = _tensors(source), _tensors(out)
    for k in a:
        assert b[k].dtype == torch.bfloat16 and torch.equal(a[k].to(torch.bfloat16), b[k]), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_padded_vocab_is_cut_on_export(tmp_path):
    src = build_random_model(tmp_path / "src", "llama", seed=2, **SMALL)
    shape = shape_from_hf_config(src).padded_for_tp(2)
    assert shape.embed_rows == 302
    from nightloom.hf.load import load_hf_weights
    from nightloom.train.model import build_model

    model = build_model(shape, 32)
    model.to_empty(device="cpu")
    model.init_weights(0)
    load_hf_weights([model], src, shape)
    assert model.tok_embeddings.weight.shape[0] == 302 and not model.tok_embeddings.weight[301:].any()
    ids = torch.randint(0, 301, (1, 32))
    ref = model_from_hf(src, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    out = export_checkpoint(_save_native(model, tmp_path), shape, tmp_path / "x", "fp32", source_config=src)
    assert all(torch.equal(v, _tensors(src)[k]) for k, v in _tensors(out).items())


def test_export_without_source_config_writes_a_llama_config(tmp_path):
    src = build_random_model(
        tmp_path / "src", "llama", seed=2, rope_scaling={"rope_type": "linear", "factor": 2.0}, **SMALL
    )
    model = model_from_hf(src, 32)
    out = export_checkpoint(_save_native(model, tmp_path), model.shape, tmp_path / "x", "fp32", tokenizer="bytes")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 301, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(out)  # a bytes run's export carries the byte tokenizer
    assert tok("é+1=")["input_ids"] == list("é+1=".encode()) and tok.eos_token_id == 0


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_qwen3_export_without_source_config_writes_a_qwen3_config(tmp_path, tied):
    """From the shape alone (a catalog model, no config.json to copy): a Qwen3ForCausalLM config whose model
    transformers loads with nothing missing and the same logits."""
    src = build_random_model(
        tmp_path / "src", "qwen3", seed=2, head_dim=24, norm_std=0.3, tie_word_embeddings=tied, **SMALL
    )
    model = model_from_hf(src, 32)
    out = export_checkpoint(_save_native(model, tmp_path), model.shape, tmp_path / "x", "fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3" and cfg["head_dim"] == 24
    assert shape_from_hf_config(out).with_(name="x") == model.shape.with_(name="x")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == "Qwen3ForCausalLM" and all(not v for v in info.values()), info
    ids = torch.randint(0, 301, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, model(ids), rtol=0, atol=1e-5)


def test_mistral_export_without_source_config_keeps_its_window(tmp_path):
    """A mistral shape's window is written (MistralConfig's default would otherwise be 4096) and transformers scores
    a sequence longer than the window as the native model does."""
    src = build_random_model(tmp_path / "src", "mistral", seed=2, sliding_window=8, **SMALL)
    model = model_from_hf(src, 32)
    out = export_checkpoint(_save_native(model, tmp_path), model.shape, tmp_path / "x", "fp32")
    assert json.loads((out / "config.json").read_text())["sliding_window"] == 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 301, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gemma3_export_without_source_config_writes_a_gemma3_text_config(tmp_path, tied):
    """From the shape alone (a catalog model): a Gemma3ForCausalLM config (layer types, both RoPE bases, the
    window, query_pre_attn_scalar, logit capping) whose model transformers loads with the same logits over a
    sequence longer than the window."""
    src = build_random_model(
        tmp_path / "src", "gemma3_text", seed=2, tie_word_embeddings=tied, final_logit_softcapping=20.0,
        **SMALL, **GEMMA3,
    )  # fmt: skip
    model = model_from_hf(src, 32)
    out = export_checkpoint(_save_native(model, tmp_path), model.shape, tmp_path / "x", "fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert cfg["layer_types"] == GEMMA3["layer_types"] and cfg["sliding_window"] == 8
    assert shape_from_hf_config(out).with_(name="x") == model.shape.with_(name="x")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == "Gemma3ForCausalLM" and all(not v for v in info.values()), info
    ids = torch.randint(0, 301, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, model(ids), rtol=0, atol=1e-5)


# -- bad input: every tensor accounted for, errors name the file and the tensor -----------------------------


@pytest.fixture
def good(tmp_path):
    return build_random_model(tmp_path / "w", "llama", seed=0, max_shard_size="60KB", **SMALL)


def _rewrite(folder, edit):
    """Apply edit(dict) to the tensors of the file holding layer 1's q_proj, keeping the index consistent."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.1.self_attn.q_proj.weight"
    file = folder / index["weight_map"][name]
    with safe_open(str(file), framework="pt") as s:
        tensors = {k: s.get_tensor(k) for k in s.keys()}
    edit(tensors)
    for k in [k for k, v in index["weight_map"].items() if v == file.name and k not in tensors]:
        del index["weight_map"][k]
    index["weight_map"] |= {k: file.name for k in tensors}
    save_file(tensors, str(file))
    index_path.write_text(json.dumps(index))
    return file


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.q_proj.weight"),
            r"tensor model.layers.1.self_attn.q_proj.weight: missing",
        ),
        (
            lambda t: t.update({"model.layers.1.self_attn.q_proj.weight": torch.zeros(8, 64)}),
            r"model-\d+-of-\d+.safetensors: tensor model.layers.1.self_attn.q_proj.weight: shape \[8, 64\], model needs \[64, 64\]",
        ),
        (
            lambda t: t.update({"model.layers.7.mlp.extra.weight": torch.zeros(2)}),
            r"model-\d+-of-\d+.safetensors: tensor model.layers.7.mlp.extra.weight: unexpected",
        ),
    ],
)
def test_bad_tensors_are_named(good, edit, message):
    _rewrite(good, edit)
    with pytest.raises(WeightsError, match=message):
        scan_checkpoint(good, shape_from_hf_config(good))


def test_truncated_file_names_the_tensor(good):
    index = json.loads((good / "model.safetensors.index.json").read_text())
    file = good / index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    with pytest.raises(WeightsError, match=rf"{file.name}: tensor \S+: truncated"):
        scan_checkpoint(good, shape_from_hf_config(good))


def test_stray_file_and_empty_folder(good, tmp_path):
    shutil.copyfile(next(good.glob("model-00001-*.safetensors")), good / "stray.safetensors")
    with pytest.raises(WeightsError, match=r"stray.safetensors: tensor .*: also in|stray.safetensors: not listed"):
        scan_checkpoint(good, shape_from_hf_config(good))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match=r"empty: no \*.safetensors files"):
        scan_checkpoint(tmp_path / "empty", shape_from_hf_config(good))
