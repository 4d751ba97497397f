"""The model-family registry: one `Family` per unit (nightloom/families/<family>.py), found by model_type.

A family holds everything nightloom decides per model_type: the config reader (config.json -> ModelShape, its
defaults and refusals; one signature for all: `read(cfg, name, strict)`), the export's architecture and the
fields it writes from a shape, the transformers classes its random model is built from, its mixture-of-experts
block names, and whether the native trainer and XTuner run it. The planner, trainer, catalog, spec checks and
hf/ ask `family_for(model_type)` (a shape's `arch` is a model_type too) instead of naming families.

Adding a family: a unit that calls `register(Family(...))` at import, listed in nightloom/families/__init__.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nightloom.shape import ModelShape

#: every family's config reader: (parsed config.json, the shape's name, strict) -> ModelShape; raises ValueError
#: naming the field. strict=False reads for FLOPs only: what the native model cannot compute is not refused.
Reader = Callable[[dict, str, bool], ModelShape]


def _source_as_is(source: dict) -> dict:
    return dict(source)


@dataclass(frozen=True, eq=False)  # a family is itself: compared and hashed by identity
class Family:
    """One model family: the model_types it reads and what nightloom does with them."""

    name: str
    #: config.json `model_type` values read by this family (the first is what its shapes' `arch` says)
    model_types: tuple[str, ...]
    read: Reader
    #: the export's `architectures` entry (None: transformers' LlamaForCausalLM is written for a source config
    #: without one)
    architecture: str | None = None
    #: a config.json written from a shape (a run that did not start from a config); None: not exportable so
    export: Callable[[ModelShape], dict] | None = None
    #: the export's config.json from the source config (gemma3: the image-text config's text decoder)
    export_source: Callable[[dict], dict] = _source_as_is
    #: transformers (config class, model class) names the random-model builder uses (hf/random_model.py)
    hf_classes: tuple[str, str] | None = None
    #: the RMSNorm weight that scales by 1 (0 for Gemma's (1 + w) norms)
    norm_unit: float = 1.0
    #: mixture-of-experts layers: (module prefix, {native stacked name: per-expert matrix name}) on the Hub
    expert_block: tuple[str, dict[str, str]] | None = None
    #: a mixture-of-experts family (its unsupported-model_type message lists it as read for planning)
    moe: bool = False
    #: the native trainer runs it (False: read for planning only)
    trained: bool = True
    #: the transformers release that added it, when after XTuner's pin (nightloom/xtuner_families.py)
    xtuner_added: str | None = None


_BY_TYPE: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` under each of its model_types; a model_type another family holds is an error."""
    taken = [t for t in family.model_types if _BY_TYPE.get(t, family) is not family]
    if taken:
        raise ValueError(f"family {family.name}: model_type {', '.join(taken)} is registered already")
    for t in family.model_types:
        _BY_TYPE[t] = family
    return family


def unregister(family: Family) -> None:
    """Remove `family` (tests that register a made-up one)."""
    for t in family.model_types:
        if _BY_TYPE.get(t) is family:
            del _BY_TYPE[t]


def family_for(model_type: str | None) -> Family | None:
    """The family reading `model_type` (a config.json's, or a shape's `arch`); None when none does."""
    return _BY_TYPE.get(model_type or "")


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(dict.fromkeys(_BY_TYPE.values()))


def model_types() -> tuple[str, ...]:
    """Every registered model_type, in registration order."""
    return tuple(_BY_TYPE)
