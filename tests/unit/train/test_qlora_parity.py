"""QLoRA parity: nightloom's quantized base (train/qlora.py) under its LoRA adapters gives PEFT + bitsandbytes'
step-1 loss and adapter gradients (BitsAndBytesConfig nf4, double quantization, fp32 compute) on the same tiny
Llama, and stores the very bytes bitsandbytes does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

from nightloom.hf.names import to_hf  # noqa: E402
from nightloom.train.lora import LoraSettings  # noqa: E402
from nightloom.train.model import build_model  # noqa: E402
from nightloom.train.parallelize import loss_fn  # noqa: E402
from nightloom.train.qlora import QuantLinear, QuantSettings, init_quantized, quantize_base  # noqa: E402
from tests.support.tiny_llama import CONFIG, MODULES, native_lora_model, save_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


def _native(folder, q: QuantSettings, lora: LoraSettings):
    return native_lora_model(folder, lora, q)


def _peft(folder, q: QuantSettings, lora: LoraSettings):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.kind,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb, dtype=torch.float32)
    cfg = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=0.0,
        target_modules=list(lora.modules),
        use_rslora=lora.rslora,
    )
    # train mode, as a trainer runs it: in eval mode bitsandbytes repacks a CPU weight for its bf16 kernel on the
    # first no-grad forward (its inference path), which a training step never takes
    return get_peft_model(base, cfg).train()


@pytest.mark.parametrize("kind,double,rslora", [("nf4", True, False), ("fp4", False, False), ("nf4", True, True)])
def test_step_one_loss_and_adapter_grads_equal_peft_bitsandbytes(llama_dir, kind, double, rslora):
    q = QuantSettings(kind, double, torch.float32)
    lora = LoraSettings(8, 16.0, 0.0, MODULES, q, rslora)  # rsLoRA: scaled by 16 / sqrt(8), PEFT's use_rslora
    model, shape = _native(llama_dir, q, lora)
    ref = _peft(llama_dir, q, lora)
    peft_params = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(1)
    pairs = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" not in name:
                continue
            if name.endswith("lora_B.weight"):  # B = 0 would give A no gradient: both start from the same values
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            hf = to_hf(name, shape).replace(".weight", ".default.weight")
            other = peft_params[f"base_model.model.{hf}"]
            other.copy_(p)
            pairs.append((name, p, other))
    assert len(pairs) == 2 * len(MODULES) * shape.layers
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 33), generator=g)
    loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-4, (loss.item(), ref_loss.item())
    for name, p, other in pairs:
        assert p.grad is not None and other.grad is not None, name
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, other.grad, atol=1e-4, rtol=0, msg=name)
    # the base is frozen and stored quantized: no gradient, 4 bits a weight
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == len(MODULES) * shape.layers
    assert all(not p.requires_grad for m in quant for p in [m.qweight, m.absmax])


def test_stored_bytes_equal_bitsandbytes_quantize_4bit(llama_dir):
    import bitsandbytes.functional as bf
    from safetensors.torch import load_file

    q = QuantSettings("nf4", True, None)
    model, shape = _native(llama_dir, q, LoraSettings(8, 16.0, 0.0, MODULES, q))
    tensors = load_file(str(llama_dir / "model.safetensors"))
    mod = model.layers["1"].ffn.w2
    w = tensors[to_hf("layers.1.ffn.w2.weight", shape)]
    packed, state = bf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert torch.equal(mod.qweight.reshape(-1), packed.reshape(-1))
    assert torch.equal(mod.absmax.reshape(-1), state.absmax)
    assert torch.equal(mod.absmax2, state.state2.absmax) and mod.offset.item() == state.offset.item()
    torch.testing.assert_close(mod.dequantized(), bf.dequantize_4bit(packed, state), atol=0, rtol=0)
    err = (mod.dequantized() - w).abs().max()
    assert 0 < err < 0.2 * w.abs().max()  # quantized (NF4 codes are at most ~0.28 of a block max apart), not a copy


def test_random_base_int8_and_refusals():
    from nightloom.catalog import MODELS

    shape = MODELS["small"]
    model = build_model(shape, 32, device="meta")
    n = quantize_base(model, QuantSettings("int8"))
    model.to_empty(device="cpu")
    model.init_weights(0)
    init_quantized(model, 0)
    ref = build_model(shape, 32, device="cpu")
    ref.init_weights(0)
    w, got = ref.layers["0"].attn.wq.weight, model.layers["0"].attn.wq.dequantized()
    assert n == 7 * shape.layers
    assert (got - w).abs().max() <= w.abs().amax(1).max() / 127 / 2 + 1e-7  # half a step of each row's scale
    assert (got - w).abs().max() > 0
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.w1 is 64 -> 176.*multiple of 32"):
        quantize_base(build_model(MODELS["tiny"], 32, device="meta"), QuantSettings("nf4"))
