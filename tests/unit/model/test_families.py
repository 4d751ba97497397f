"""A model family is one registered unit (nightloom/families/): every family's model_type stands in few source
files, and a made-up family registered in a test alone is read, built, loaded and exported."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from nightloom.families import families, family_for, register, unregister
from nightloom.families.dense import Dense, dense_family
from nightloom.hf.config import config_for_export, shape_from_config, shape_from_hf_config

ROOT = Path(__file__).resolve().parents[3]
#: what counts: the .py files under nightloom/ holding one of a family's model_types as a quoted string literal
#: ('qwen3_moe' or "qwen3_moe"), the family's own unit included. Prose (docstrings naming a family in words,
#: `qwen3_moe` in backticks) does not count: only a literal can drive a branch or a table. The limit is the unit
#: plus two: a catalog row of published sizes, and a default (shape.py's `arch`, the ledger's demo family).
MAX_FILES = 3


def files_naming(model_type: str) -> set[str]:
    pattern = re.compile(rf"""(["']){re.escape(model_type)}\1""")
    return {
        str(p.relative_to(ROOT))
        for p in (ROOT / "nightloom").rglob("*.py")
        if pattern.search(p.read_text(encoding="utf-8"))
    }


@pytest.mark.parametrize("family", families(), ids=lambda f: f.name)
def test_a_family_stands_in_at_most_three_source_files(family):
    files = set().union(*(files_naming(t) for t in family.model_types))
    assert len(files) <= MAX_FILES, f"{family.name}: {sorted(files)}"


def test_every_supported_family_is_registered_once():
    names = [f.name for f in families()]
    assert len(names) == len(set(names))
    for name in ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "deepseek_v3"):
        assert name in names
    for family in families():
        for model_type in family.model_types:
            assert family_for(model_type) is family


@pytest.mark.parametrize("family", families(), ids=lambda f: f.name)
def test_every_reader_has_the_one_signature_and_every_builder_names_real_classes(family):
    inspect.signature(family.read).bind({}, "name", True)  # read(cfg, name, strict)
    if family.hf_classes is not None:
        import transformers

        for cls in family.hf_classes:
            assert hasattr(transformers, cls), cls


def test_a_model_type_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="model_type llama is registered already"):
        register(dense_family(Dense("llama", "LlamaForCausalLM")))
    assert family_for("llama").name == "llama"


#: a renamed Llama: the whole family is this one line of data (its math is Llama's)
TINYLLAMA_X = Dense(
    "tinyllama_x", "LlamaForCausalLM", o_bias=True, mlp_bias=True, hf_classes=("LlamaConfig", "LlamaForCausalLM")
)
SIZES = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


@pytest.fixture
def tinyllama_x():
    family = register(dense_family(TINYLLAMA_X))
    yield family
    unregister(family)
    assert family_for("tinyllama_x") is None


def test_an_unregistered_model_type_is_refused_by_name():
    with pytest.raises(ValueError, match="model_type: unsupported 'tinyllama_x'; supported: .*llama"):
        shape_from_config({"model_type": "tinyllama_x", **SIZES})


def test_a_made_up_family_registered_in_one_unit_reads_builds_loads_and_exports(tinyllama_x, tmp_path):
    """Registering the unit is all it takes: config.json -> ModelShape (the family's reader), a random model (its
    transformers classes), the native model loaded from it (Hugging Face names in), and the export's config and
    names (out)."""
    import torch
    from safetensors.torch import load_file

    from nightloom.hf.load import model_from_hf
    from nightloom.hf.names import expected_shapes, to_hf
    from nightloom.hf.random_model import build_random_model

    assert family_for("tinyllama_x") is tinyllama_x and tinyllama_x in families()
    folder = build_random_model(tmp_path / "x", "tinyllama_x", seed=1, **SIZES)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "tinyllama_x"  # transformers writes its class's own model_type
    (folder / "config.json").write_text(json.dumps(cfg))

    shape = shape_from_hf_config(folder)
    assert (shape.arch, shape.layers, shape.hidden, shape.heads, shape.kv_heads) == ("tinyllama_x", 2, 32, 4, 2)
    assert (shape.ffn_hidden, shape.vocab, shape.max_seq, shape.qk_norm, shape.qkv_bias) == (64, 96, 64, False, False)
    assert shape.rope_theta == 500000.0  # the random model's (DEMO_CONFIG), read from its rope_parameters

    stored = {}
    for f in folder.glob("*.safetensors"):
        stored |= load_file(f)
    model = model_from_hf(folder, 16)
    native = dict(model.named_parameters())
    assert {to_hf(n, shape) for n in native} == set(stored) == set(expected_shapes(shape))
    for n, p in native.items():  # names in: each native tensor is the Hugging Face tensor of its name
        assert torch.equal(p.detach(), stored[to_hf(n, shape)]), n

    out = config_for_export(shape, None, "fp32")  # names out: the export's config is the family's
    assert (out["model_type"], out["architectures"], out["mlp_bias"]) == ("tinyllama_x", ["LlamaForCausalLM"], False)
    assert config_for_export(shape, cfg, "fp32")["architectures"] == cfg["architectures"]
