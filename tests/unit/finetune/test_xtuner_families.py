"""XTuner's transformers pin (4.48) cannot load Qwen3 or Gemma 3: a spec asking XTuner to fine-tune one is refused
at validate time, naming the field and the native trainer; a Llama or Qwen2 base is not."""

from __future__ import annotations

import pytest

from nightloom.hf.random_model import build_random_model
from nightloom.spec import SpecError
from nightloom.spec.load import parse_spec

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64}


def _spec(weights):
    return {
        "name": "x",
        "dataset": {"path": "d.jsonl", "sample": True, "sample_kind": "alpaca"},
        "model": {"weights": str(weights), "tokenizer": str(weights)},
        "train": {"backend": "xtuner", "xtuner": {}, "global_batch": 4},
        "cluster": {"nodes": 1, "gpus_per_node": 2},
    }


@pytest.mark.parametrize(("arch", "added"), [("qwen3", "4.51"), ("gemma3_text", "4.50")])
def test_xtuner_refuses_a_family_its_transformers_lacks(tmp_path, arch, added):
    weights = build_random_model(tmp_path / arch, arch, num_key_value_heads=1, **TINY)
    with pytest.raises(SpecError) as e:
        parse_spec(_spec(weights), base_dir=tmp_path)
    msg = str(e.value)
    assert f"model.weights: a {arch} model: XTuner 0.2.0 runs transformers 4.48.0" in msg, msg
    assert f"(added in transformers {added})" in msg and "train.backend: native" in msg and "train.lora" in msg


def test_xtuner_keeps_a_family_it_loads(tmp_path):
    from nightloom.spec.checks import _xtuner_family_errors

    weights = build_random_model(tmp_path / "qwen2", "qwen2", num_key_value_heads=1, **TINY)
    assert _xtuner_family_errors(_spec(weights), lambda p: tmp_path / p if p else None) == []
