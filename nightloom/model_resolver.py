"""The one resolver of a run's model shape: a catalog name or a Hugging Face config.json, with the vocabulary the
tokenizer asks for. The planner, cost, the flow, XTuner's FLOP count and the spec checks all call it, so a new
model family only has to teach `nightloom/hf/config.py` to read it (and `nightloom/shape.py` to hold it).
"""

from __future__ import annotations

from pathlib import Path

from nightloom.catalog import MODELS, get_model
from nightloom.hf.config import shape_from_hf_config
from nightloom.shape import ModelShape
from nightloom.spec import ModelSpec
from nightloom.tokenizer import resolve_vocab


def shape_from_name_or_config(name_or_config: str | Path, *, strict: bool = True) -> ModelShape:
    """A catalog name, or a path to a Hugging Face config.json (a folder holding one works too). Anything that
    looks like a path (a separator, `.json`, or an existing file) is read as one, so a missing file says so."""
    s = str(name_or_config)
    if s in MODELS:
        return MODELS[s]
    p = Path(s).expanduser()
    if isinstance(name_or_config, Path) or "/" in s or p.suffix == ".json" or p.exists():
        return shape_from_hf_config(p, strict=strict)
    return get_model(s)


def model_shape(model: ModelSpec, *, with_tokenizer_vocab: bool = True) -> ModelShape:
    """The run's model: its HF config (model.config, or config.json in model.weights once resolved) or the
    catalog's model.name, with the embedding rows `model.vocab` asks for (a number, or the tokenizer's size)."""
    shape = shape_from_hf_config(model.config) if model.config else get_model(model.name)
    if not with_tokenizer_vocab:
        return shape
    return shape.with_(vocab=resolve_vocab(model, shape.vocab))
