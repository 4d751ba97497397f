"""The table of sampled completions a grpo run writes every `train.grpo.log_completions_every` steps:
`<run_dir>/completions/step-NNNNNN.json` (prompt, completion, total reward, each function's, advantage), written
then renamed; the task layer shows the last one as a Prefect table artifact. No torch: the orchestrator reads it."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from nightloom.util import atomic_write_text

COMPLETIONS_DIR = "completions"


class CompletionsTable(BaseModel):
    """One step's sampled completions: each row prompt, completion, reward, every function's score, advantage."""

    step: int
    rows: list[dict[str, str | float]]


def table_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / COMPLETIONS_DIR / f"step-{step:06d}.json"


def write_table(run_dir: str | Path, table: CompletionsTable) -> Path:
    path = table_path(run_dir, table.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(table.model_dump(), indent=1) + "\n")
    return path


def latest_table(run_dir: str | Path) -> CompletionsTable | None:
    """The newest table of a run folder, or None when it wrote none."""
    found = sorted((Path(run_dir) / COMPLETIONS_DIR).glob("step-*.json"))
    return CompletionsTable.model_validate_json(found[-1].read_text(encoding="utf-8")) if found else None
