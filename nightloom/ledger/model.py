"""The model a ledger row names: the name and family of the model the run trained, from its resolved shape.

A run whose model comes from model.config or model.weights was once recorded under the spec's default catalog name
(`tiny`); `run_model` is now the one place a row's model and family come from, for a new row (`ledger_fields`, from a
spec alone, as `tasks/record.py` and a run that fails before training record it), for the planner's calibration
(`nightloom.ledger.calibration_for_spec`, keyed by GPU type and family) and for rows written before (migration
0006 reads `run_model_from_job` of the row's run folder). Catalog models keep their catalog name and its first word
as family (`llama2-70b`, `llama2`); Hugging Face models are named by their weights folder (else the config's
`_name_or_path`, folder or file name) and their family is the config's model_type (`qwen2`, `llama` ...).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from nightloom.families import DEMO_FAMILY  # what model.build_demo_weights builds (hf.random_model), XTuner's too
from nightloom.model_resolver import model_shape
from nightloom.shape import ModelShape

MODEL_CHARS = 128  # the ledger's model column
UNKNOWN_FAMILY = "unknown"  # a Hugging Face config that cannot be read (yet) when the row is opened


@dataclass(frozen=True)
class RunModel:
    """What a ledger row says the run trained: a name for people and the family calibrations are keyed by."""

    name: str
    family: str


def model_family(model: str) -> str:
    """A catalog name's family, its first dash-separated word ('llama2-70b' → 'llama2', 'tiny-tied' → 'tiny'): the
    family of a catalog model, and of rows whose run folder no longer says what they trained."""
    return model.split("-", 1)[0]


def _base_name(ref: str) -> str:
    """The last part of a folder, file or s3:// prefix ('../models/demo-llama/' → 'demo-llama'), so a row names
    the model and not where it lay; a Hub id ('Qwen/Qwen2.5-0.5B', one slash, not a path) is kept whole."""
    ref = ref.rstrip("/")
    is_path = "://" in ref or ref.startswith(("/", ".", "~")) or ref.count("/") > 1
    return (ref.rsplit("/", 1)[-1] if is_path else ref) or ref


def run_model(shape: ModelShape, hf_config: str | None = None, weights: str | None = None) -> RunModel:
    """The model a run trained, from its resolved `shape`: a catalog model (no `hf_config`) by its catalog name and
    that name's family; a Hugging Face one by its `weights` folder's name (else the name the config gave the shape)
    and its model_type (shape.arch), so the chat demo's Qwen2 reads `chat-sft-demo-qwen2`, `qwen2`."""
    if not hf_config:
        return RunModel(shape.name, model_family(shape.name))
    return RunModel(_base_name(weights or shape.name)[:MODEL_CHARS], shape.arch)


def _xtuner_base(spec) -> str | None:
    """An XTuner run's base model (model.weights, or its older alias train.xtuner.base_model); None otherwise."""
    xs = spec.train.xtuner
    if spec.train.backend != "xtuner":
        return None
    return spec.model.weights or (xs.base_model if xs is not None else None) or None


def _xtuner_run_model(base: str, built_tiny: bool) -> RunModel:
    """What an XTuner run trains: its base folder's name and its config.json's model_type (XTuner trains the Hugging
    Face model as it lies; nightloom resolves no shape for it); a base not built or read yet is named by its folder,
    DEMO_FAMILY when nightloom builds it (finetune/tiny_model.py builds a Llama) or 'unknown'."""
    family = DEMO_FAMILY if built_tiny else UNKNOWN_FAMILY
    if "://" not in base:
        try:
            cfg = json.loads((Path(base) / "config.json").read_text(encoding="utf-8"))
            family = str(cfg.get("model_type") or family)
        except (OSError, ValueError):
            pass
    return RunModel(_base_name(base)[:MODEL_CHARS], family)


def spec_run_model(spec) -> RunModel:
    """The model a run of `spec` (a RunSpec) trains, resolved as the planner and trainer resolve it (the tokenizer
    is not read: the vocabulary names nothing). A Hugging Face config that cannot be read yet (demo weights not
    built, a run failing before) gives its weights' or config's name and family 'unknown' (a demo's: the Llama it
    will build) rather than an error, so such a run still gets its ledger row."""
    base = _xtuner_base(spec)
    if base:
        return _xtuner_run_model(base, bool(spec.train.xtuner and spec.train.xtuner.build_tiny_base_model))
    try:
        shape = model_shape(spec.model, with_tokenizer_vocab=False)
    except (OSError, ValueError, KeyError):
        if not spec.model.config:
            raise
        family = DEMO_FAMILY if spec.model.build_demo_weights else UNKNOWN_FAMILY
        return RunModel(_base_name(spec.model.weights or spec.model.config)[:MODEL_CHARS], family)
    return run_model(shape, spec.model.config, spec.model.weights)


def run_task(task: str, backend: str) -> str:
    """The ledger's task of a run: train.task, but `sft` for an XTuner run (XTuner fine-tunes chats)."""
    return "sft" if backend == "xtuner" else task


def run_task_from_job(run_dir: Path) -> str | None:
    """The task the newest job*.json in `run_dir` trained; None when no readable job file is left."""
    try:
        jobs = sorted(run_dir.glob("job*.json"), key=lambda p: p.stat().st_mtime)
        train = json.loads(jobs[-1].read_text(encoding="utf-8"))["train"] if jobs else None
        return run_task(str(train.get("task", "pretrain")), str(train.get("backend", "native"))) if train else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def ledger_fields(spec) -> dict[str, Any]:
    """A new ledger row's fields that `spec` alone gives: `Ledger.start_run`'s keywords but run_id and plan. One
    builder for every row (the pipeline's, a run that fails while sharding), so none names the model otherwise."""
    model = spec_run_model(spec)
    return dict(
        spec_hash=spec.spec_hash(),
        name=spec.name,
        model=model.name,
        family=model.family,
        task=run_task(spec.train.task, spec.train.backend),
        cluster=spec.cluster.name,
        provider=spec.cluster.provider.kind,
        gpu_type=spec.cluster.gpu_type,
        world_size=spec.world_size,
        currency=spec.schedule.currency,
    )


@functools.cache
def _shape_reader() -> TypeAdapter[ModelShape]:
    """Reads a job file's `model` back into a ModelShape (built once: a migration reads one job per row)."""
    return TypeAdapter(ModelShape)


def run_model_from_job(run_dir: Path) -> RunModel | None:
    """What the newest job*.json in `run_dir` says the run trained (its resolved shape, config and weights); None
    when the folder, or a readable job file in it, is gone: the caller then leaves the row as it was."""
    try:
        jobs = sorted(run_dir.glob("job*.json"), key=lambda p: p.stat().st_mtime)
        if not jobs:
            return None
        job = json.loads(jobs[-1].read_text(encoding="utf-8"))
        shape = _shape_reader().validate_python(job["model"])
        return run_model(shape, job.get("hf_config"), job.get("weights"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # pydantic's ValidationError is a ValueError
        return None
