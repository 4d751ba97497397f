"""QLoRA on CUDA (bitsandbytes' GPU kernels, bf16 compute): step 1's loss and the adapters' gradients equal PEFT +
bitsandbytes (BitsAndBytesConfig nf4, double quantization, bf16 compute dtype) on the same tiny Llama, as the CPU
parity test (tests/unit/train/test_qlora_parity.py) checks in fp32; bf16 compute leaves a looser tolerance."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.gpu  # tests/conftest.py skips every gpu-marked test without CUDA

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=64,
    initializer_range=0.05,
    tie_word_embeddings=False,
)


def test_step_one_on_cuda_equals_peft_bitsandbytes_in_bf16(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from nightloom.hf.config import shape_from_hf_config
    from nightloom.hf.load import load_hf_weights
    from nightloom.hf.names import to_hf
    from nightloom.train.lora import LoraSettings, apply_lora, init_lora
    from nightloom.train.model import build_model
    from nightloom.train.parallelize import loss_fn
    from nightloom.train.qlora import QuantSettings, quantize_base

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    dev = torch.device("cuda")
    q = QuantSettings("nf4", True, torch.bfloat16)
    lora = LoraSettings(8, 16.0, 0.0, MODULES, q)
    shape = shape_from_hf_config(tmp_path)
    model = build_model(shape, 32, device="meta")
    quantize_base(model, q)
    apply_lora(model, lora)
    model.to_empty(device=dev)
    model.init_weights(0)
    init_lora(model, 0)
    load_hf_weights([model], tmp_path, shape, log=lambda _: None)
    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb, dtype=torch.float32, device_map=dev)
    ref = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(MODULES))).train()
    theirs = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(1)
    pairs = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                if name.endswith("lora_B.weight"):
                    p.copy_(torch.randn(p.shape, generator=g).mul_(0.05).to(dev))
                other = theirs["base_model.model." + to_hf(name, shape).replace(".weight", ".default.weight")]
                other.copy_(p)
                pairs.append((name, p, other))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 33), generator=g).to(dev)
    loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-3, (loss.item(), ref_loss.item())
    for name, p, other in pairs:
        torch.testing.assert_close(p.grad, other.grad, atol=2e-3, rtol=2e-2, msg=name)
