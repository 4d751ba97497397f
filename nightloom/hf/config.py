"""config.json -> ModelShape: the one parser of Hugging Face model configs (planner, trainer, XTuner, export).

What each model_type's config means lives in its family's unit (nightloom/families/): its reader, defaults and
refusals, and the config an export writes. This module reads the file, asks the registry for the family and
names the file in errors.
"""

from __future__ import annotations

import json
from pathlib import Path

from nightloom.families import families, family_for
from nightloom.shape import ModelShape


class HFConfigError(ValueError):
    """A config.json that cannot be used; the message names the file and the field."""


def config_path(path: str | Path) -> Path:
    """A config.json path from a file or a folder holding one."""
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def read_config(path: str | Path) -> dict:
    """The parsed config.json object; errors name the file (and line for bad JSON)."""
    p = config_path(path)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFConfigError(f"{p}: config file not found") from None
    except json.JSONDecodeError as err:
        raise HFConfigError(f"{p}:{err.lineno}: invalid JSON: {err.msg}") from None
    if not isinstance(cfg, dict):
        raise HFConfigError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def shape_from_config(cfg: dict, name: str = "hf", strict: bool = True) -> ModelShape:
    """A ModelShape from a parsed config.json; raises ValueError naming the field.

    strict=False reads the shape only (FLOP counts for a model another trainer runs, e.g. XTuner): fields the
    native model cannot compute are then not refused and an unsupported RoPE scaling is left out."""
    mtype = cfg.get("model_type")
    family = family_for(mtype)
    if family is not None:
        return family.read(cfg, name, strict)
    supported = ", ".join(t for f in families() if not f.moe for t in f.model_types)
    planning = ", ".join(t for f in families() if f.moe for t in f.model_types)
    raise ValueError(f"model_type: unsupported {mtype!r}; supported: {supported} (and for planning: {planning})")


def shape_from_hf_config(path: str | Path, strict: bool = True) -> ModelShape:
    """A ModelShape from a config.json file (or a folder holding one); errors start with the file name."""
    p = config_path(path)
    cfg = read_config(p)
    # a model folder's config.json is named after the folder; a loose `qwen3-8b.json` after its own stem
    name = str(cfg.get("_name_or_path") or (p.parent.name if p.name == "config.json" else p.stem) or p.stem)
    try:
        return shape_from_config(cfg, name, strict)
    except ValueError as err:
        raise HFConfigError(f"{p}: {err}") from None


def config_for_export(shape: ModelShape, source: dict | None, dtype: str) -> dict:
    """The config.json of an export: the source config when the run started from one (dtype updated; its family
    may rewrite it: a gemma3 image-text source gives its text_config as gemma3_text), else a config of the
    shape's family written from the shape (what transformers' config class of that family reads)."""
    if source is not None:
        family = family_for(source.get("model_type"))
        cfg = family.export_source(source) if family is not None else dict(source)
        arch = family.architecture if family is not None else None
        cfg.setdefault("architectures", [arch or "LlamaForCausalLM"])
    else:
        family = family_for(shape.arch)
        if family is None or family.export is None:
            raise ValueError(f"model {shape.name}: export needs a llama-style model, got {shape.arch!r}")
        cfg = family.export(shape)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    return cfg
