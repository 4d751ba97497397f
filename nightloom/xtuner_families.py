"""Which model families XTuner can load: xtuner 0.2.0 pins transformers 4.48.0, whose model classes stop there.

Checked (2026-12, CPU, torch 2.13): with the pin overridden, xtuner 0.2.0 imports and trains a LoRA through
transformers 4.57.6 (the last 4.x); with transformers 5.x it fails at import (`xtuner/utils/
handle_moe_load_and_save.py:13` imports `is_safetensors_available`, gone from `transformers.utils`). nightloom's
XTuner node env keeps the declared pin, so families added to transformers after 4.48 are refused for the XTuner
backend, before anything is rented, and sent to the native trainer, which loads them."""

from __future__ import annotations

XTUNER_TRANSFORMERS = "4.48.0"
#: model_type -> the transformers release that added it (after XTuner's pin)
ADDED_AFTER_PIN = {
    "gemma3": "4.50",
    "gemma3_text": "4.50",
    "qwen3": "4.51",
    "qwen3_moe": "4.51",
    "llama4": "4.51",
    "llama4_text": "4.51",
    "deepseek_v3": "4.53",
    "gpt_oss": "4.55",
}


def xtuner_refusal(model_type: str | None) -> str | None:
    """Why XTuner cannot load a `model_type` model (None when it can), with where to train it instead."""
    added = ADDED_AFTER_PIN.get(model_type or "")
    if added is None:
        return None
    return (
        f"a {model_type} model: XTuner 0.2.0 runs transformers {XTUNER_TRANSFORMERS}, which has no {model_type} "
        f"(added in transformers {added}); fine-tune it on the native trainer instead: train.backend: native with "
        "train.task: sft and train.lora (docs/finetuning.md)"
    )
