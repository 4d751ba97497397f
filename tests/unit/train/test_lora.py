"""LoRA on the native model (train/lora.py) in one process: the adapted forward equals the model with
W + (alpha/r)·B A merged in, only the adapters train, targets map to Hugging Face module names, the spec refuses
what cannot work, and the exporter's merge and PEFT key names are PEFT's."""

from __future__ import annotations

import pytest
import torch

from nightloom.catalog import MODELS
from nightloom.spec import LoraSpec
from nightloom.train.lora import LoraSettings, adapter_parameters, apply_lora, init_lora, targeted, trainable
from nightloom.train.model import build_model

ALL = LoraSettings(4, 8.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def _model(shape, lora: LoraSettings | None, seed: int = 1):
    m = build_model(shape, 32, device="meta")
    if lora is not None:
        apply_lora(m, lora)
    m.to_empty(device="cpu")
    m.init_weights(seed)
    if lora is not None:
        init_lora(m, seed)
    return m


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_adapted_forward_equals_the_merged_weights(name):
    shape = MODELS[name]
    m = _model(shape, ALL)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # B starts at 0: give it values so the adapters change the output
    x = torch.randint(0, shape.vocab, (2, 16))
    ref = _model(shape, None)
    sd = m.state_dict()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(sd[n])
            stem = n[: -len(".weight")]
            if f"{stem}.lora_A.weight" in sd:
                p += ALL.scaling * sd[f"{stem}.lora_B.weight"] @ sd[f"{stem}.lora_A.weight"]
    assert (m(x) - ref(x)).abs().max() < 1e-5
    assert (m(x) - _model(shape, None)(x)).abs().max() > 1e-3  # the adapters do change it


def test_starts_as_the_base_model_and_trains_only_the_adapters():
    shape = MODELS["tiny"]
    m, base = _model(shape, ALL), _model(shape, None)
    x = torch.randint(0, shape.vocab, (2, 16))
    assert torch.equal(m(x), base(x))  # B = 0
    m(x).float().pow(2).mean().backward()
    params = dict(m.named_parameters())
    assert all((".lora_" in n) == p.requires_grad for n, p in params.items())
    assert all(p.grad is None for n, p in params.items() if ".lora_" not in n)
    assert sum(p.numel() for p in trainable(m)) == adapter_parameters(shape, ALL) == 18688
    # A's gradient is 0 while B is 0; B's is not
    assert all(params[n].grad.abs().max() > 0 for n in params if n.endswith("lora_B.weight"))


def test_targets_are_hugging_face_module_names():
    shape = MODELS["tiny"]
    m = build_model(shape, 32, device="meta")
    names = [n for n, _, _ in targeted(m, LoraSettings(4, 8.0, 0.0, ("q_proj", "down_proj")))]
    assert names == [f"layers.{i}.{x}" for i in range(shape.layers) for x in ("attn.wq", "ffn.w2")]
    assert LoraSpec(targets=["v_proj", "q_proj"]).modules() == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="unknown module \\['qkv'\\]"):
        LoraSpec(targets=["qkv"])


def test_spec_refuses_a_rank_tp_does_not_divide_and_the_xtuner_backend():
    from nightloom.spec.load import parse_spec

    base = {
        "name": "x",
        "dataset": {"path": "d.jsonl"},
        "parallel": {"tp": 2},
        "cluster": {"gpus_per_node": 2},
        "train": {"lora": {"rank": 3}},
    }
    with pytest.raises(Exception, match=r"train.lora.rank: 3 is not a multiple of parallel.tp \(2\)"):
        parse_spec(base)
    xt = {**base, "parallel": "auto", "train": {"backend": "xtuner", "xtuner": {}, "lora": {"rank": 4}}}
    with pytest.raises(Exception, match="train.lora: native backend only"):
        parse_spec(xt)


def test_merge_and_peft_names(tmp_path):
    import json

    from safetensors.torch import load_file

    from nightloom.hf.export import merge_lora, write_peft_adapter

    w, a, b = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    state = {"model.layers.0.attn.wq.weight": w, "model.layers.0.attn.wq.lora_A.weight": a}
    state["model.layers.0.attn.wq.lora_B.weight"] = b
    merged, adapters = merge_lora(state, 4.0)
    assert set(merged) == {"model.layers.0.attn.wq.weight"} and len(adapters) == 2
    assert torch.allclose(merged["model.layers.0.attn.wq.weight"], w + 4.0 * b @ a)
    write_peft_adapter(
        tmp_path, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a}, ALL, torch.float32, ""
    )
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["target_modules"][0] == "q_proj"
    assert list(load_file(str(tmp_path / "adapter_model.safetensors"))) == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    ]
