"""The tiny Llama the LoRA/QLoRA/DoRA parity tests share: widths bitsandbytes' CPU kernel takes (outputs a multiple
of 32) and whole 64-blocks per row, saved as a Hugging Face folder from a fixed seed."""

from __future__ import annotations

from pathlib import Path

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


def save_tiny_llama(folder: Path) -> Path:
    """Random weights (seed 0) of CONFIG's Llama, saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(folder)
    return folder


def native_lora_model(folder: Path, lora, quant=None):
    """nightloom's model of a saved Hugging Face folder with `lora`'s adapters (train/lora.LoraSettings), its base
    quantized by `quant` (train/qlora.QuantSettings; default lora.quant) when given, the folder's weights loaded:
    (model, shape)."""
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.hf.load import load_hf_weights
    from nightloom.train.lora import apply_lora, init_lora
    from nightloom.train.model import build_model
    from nightloom.train.qlora import quantize_base

    shape = shape_from_hf_config(folder)
    model = build_model(shape, 32, device="meta")
    quant = quant if quant is not None else lora.quant
    if quant is not None:
        quantize_base(model, quant)
    apply_lora(model, lora)
    model.to_empty(device="cpu")
    model.init_weights(0)
    init_lora(model, 0)
    load_hf_weights([model], folder, shape, log=lambda _: None)
    return model, shape
