"""Which model families XTuner can load: xtuner 0.2.0 pins transformers 4.48.0, whose model classes stop there.

Checked (2026-12, CPU, torch 2.13): with the pin overridden, xtuner 0.2.0 imports and trains a LoRA through
transformers 4.57.6 (the last 4.x); with transformers 5.x it fails at import (`xtuner/utils/
handle_moe_load_and_save.py:13` imports `is_safetensors_available`, gone from `transformers.utils`). nightloom's
XTuner node env keeps the declared pin, so families added to transformers after 4.48 are refused for the XTuner
backend, before anything is rented, and sent to the native trainer, which loads them."""

from __future__ import annotations

from nightloom.families import family_for

XTUNER_TRANSFORMERS = "4.48.0"
#: model_types nightloom reads no family of, with the transformers release that added them (after XTuner's pin); a
#: registered family says its own (Family.xtuner_added, nightloom/families/)
ADDED_AFTER_PIN = {
    "llama4": "4.51",
    "llama4_text": "4.51",
    "gpt_oss": "4.55",
}


def xtuner_refusal(model_type: str | None) -> str | None:
    """Why XTuner cannot load a `model_type` model (None when it can), with where to train it instead."""
    family = family_for(model_type)
    added = family.xtuner_added if family is not None else ADDED_AFTER_PIN.get(model_type or "")
    if added is None:
        return None
    return (
        f"a {model_type} model: XTuner 0.2.0 runs transformers {XTUNER_TRANSFORMERS}, which has no {model_type} "
        f"(added in transformers {added}); fine-tune it on the native trainer instead: train.backend: native with "
        "train.task: sft and train.lora (docs/finetuning.md)"
    )
