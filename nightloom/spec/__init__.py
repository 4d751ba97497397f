"""The run spec: what to train, on what data, where, how, and what counts as success.

The package's own namespace is the schema (`from nightloom.spec import RunSpec, SpecError, ...`); it imports only
the floor-0 leaves below, so the tokenizer, the providers and the Run form can import it. Its modules:

- schema.py: the pydantic models, their defaults and per-field rules (RunSpec and its sections);
- base.py: what every section shares (the pydantic base that refuses unknown keys, SpecError);
- cluster.py: the cluster section (providers, NCCL);
- stage_list.py, micro_batch.py: the small arithmetic the schema's validators share with the planner and trainer;
- load.py (floor 2): reading a spec, every error as `FILE:LINE: field.path: reason`;
- checks.py (floor 2): the checks that need a model, a tokenizer or the filesystem;
- doc.py (floor 2): docs/spec.md's field reference, `python -m nightloom.spec.doc --write docs/spec.md`.
"""

from __future__ import annotations

from nightloom.spec import cluster
from nightloom.spec.base import SpecError
from nightloom.spec.cluster import *  # noqa: F403 - the cluster section's names (cluster.__all__, listed there once)
from nightloom.spec.lora import LORA_TARGETS, LoraSpec
from nightloom.spec.schema import (
    HASH_NEUTRAL_DEFAULTS,
    DaskSpec,
    DatasetSpec,
    GoldenSpec,
    LedgerSpec,
    ModelSpec,
    ParallelSpec,
    RecoverySpec,
    RunSpec,
    ScheduleSpec,
    ShardingSpec,
    StorageSpec,
    TokenizerSpec,
    TrainSpec,
    ValidateSpec,
    WindowSpec,
    XTunerSpec,
)

__all__ = [
    *cluster.__all__,
    "HASH_NEUTRAL_DEFAULTS",
    "LORA_TARGETS",
    "DaskSpec",
    "DatasetSpec",
    "GoldenSpec",
    "LedgerSpec",
    "LoraSpec",
    "ModelSpec",
    "ParallelSpec",
    "RecoverySpec",
    "RunSpec",
    "ScheduleSpec",
    "ShardingSpec",
    "SpecError",
    "StorageSpec",
    "TokenizerSpec",
    "TrainSpec",
    "ValidateSpec",
    "WindowSpec",
    "XTunerSpec",
]
