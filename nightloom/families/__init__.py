"""Model families, one registered unit each (nightloom/families/registry.py): `family_for(model_type)`,
`families()`. The units below register themselves on import; their order is the order `families()` lists."""

from __future__ import annotations

from nightloom.families.registry import Family, Reader, families, family_for, model_types, register, unregister

# each unit registers its family; this order is families()' (dense, gemma3, mixtures of experts, gpt2)
# isort: off
from nightloom.families import dense, gemma3, moe, deepseek_v3, gpt2  # noqa: E402, F401
# isort: on

#: the family of the demo's random model when no config says otherwise (hf/random_model.py)
DEMO_FAMILY = dense.LLAMA.model_type

__all__ = ["DEMO_FAMILY", "Family", "Reader", "families", "family_for", "model_types", "register", "unregister"]
