"""The benchmark stage of a run, after training: the demo task built if asked, the held-out prompts, lm-eval on
the export and the base (cached), the gates, and what the run folder keeps (benchmarks.json, completions.md; a
failed gate's mark in the export, which is kept)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from nightloom.benchmarks.answer_task import ANSWER, ensure_answer_task
from nightloom.benchmarks.compare import BenchRow, check_benchmarks, completion_rows, figures, rows, table_rows
from nightloom.benchmarks.demo_task import chatml_pairs, ensure_demo_task, heldout_split
from nightloom.benchmarks.launch import BenchmarkError, Runner, run_benchmarks
from nightloom.benchmarks.records import BenchResult
from nightloom.gates import Verdict
from nightloom.ledger.records import Figure
from nightloom.records import Record
from nightloom.spec.benchmarks import BenchmarksSpec
from nightloom.util import atomic_write_text

RESULT_FILE, COMPLETIONS_FILE, FAILED_MARK = "benchmarks.json", "completions.md", "BENCHMARKS_FAILED.json"


class BenchReport(Record):
    """What the stage hands the flow: verdicts, ledger figures, the table's rows, completions, seconds."""

    verdicts: list[Verdict]
    figures: list[Figure] = Field(default_factory=list)
    rows: list[BenchRow] = Field(default_factory=list)
    completions: list[dict] = Field(default_factory=list)
    seconds: float = 0.0
    base_cached: bool = False


def prompts_for(settings: BenchmarksSpec, held: dict[str, list]) -> list[str]:
    """The spec's prompts, else the held-out conversations' first user turns, else held-out prompts with answers."""
    texts = [t for t in held.get("text", []) if t]
    found = [q for q, _ in chatml_pairs(texts)] or (texts if ANSWER in held else [])
    return settings.prompts or found[: settings.completions]


def ensure_task(settings: BenchmarksSpec, held: dict[str, list]) -> None:
    """validate.benchmarks.demo_task on first use: a generative exact-answer task from held-out prompts with an
    `answer` column (answer_task.py), else the multiple-choice task from held-out chats (demo_task.py)."""
    if settings.demo_task is None or settings.include_path is None:
        return
    if ANSWER in held:
        ensure_answer_task(
            settings.include_path, settings.demo_task, held["text"], held[ANSWER], settings.max_new_tokens
        )
    else:
        ensure_demo_task(settings.include_path, settings.demo_task, [t for t in held.get("text", []) if t])


def markdown_table(table: list[dict]) -> str:
    """A list of same-keyed rows as a Markdown table (cells on one line, pipes escaped)."""
    if not table:
        return ""

    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    head = list(table[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[k]) for k in head) + " |" for r in table]) + "\n"


def run_stage(
    settings: BenchmarksSpec,
    run_dir: Path,
    export_dir: str | None,
    base_dir: str | None,
    shards_dir: str | None,
    runner: Runner | None = None,
) -> BenchReport:
    """Benchmark the export (and the base) here or through `runner` (a rented node); a missing export or a failed
    lm-eval is a verdict, not an exception."""
    if export_dir is None:
        why = "no export to score (train.export: none, or the run stopped before its last step)"
        return BenchReport(verdicts=[Verdict(name="benchmarks", passed=not settings.gates, skipped=True, reason=why)])
    held = heldout_split(shards_dir) if shards_dir and "://" not in shards_dir else {}
    ensure_task(settings, held)
    try:
        prompts = prompts_for(settings, held)
        result = run_benchmarks(
            settings, export_dir, base_dir, run_dir, run_dir.parent / ".benchmarks", prompts, runner
        )
    except BenchmarkError as e:
        return BenchReport(verdicts=[Verdict(name="benchmarks", passed=False, reason=str(e)[-1500:])])
    return report(settings, result, run_dir, Path(export_dir))


def report(settings: BenchmarksSpec, result: BenchResult, run_dir: Path, export_dir: Path) -> BenchReport:
    """Rows, gates and figures of a result; the run folder's files; the export marked when a gate failed."""
    table = rows(result)
    verdicts = check_benchmarks(settings, table)
    sides = completion_rows(result)
    data = {"result": result.model_dump(), "rows": [r.model_dump() | {"diff": r.diff} for r in table]}
    atomic_write_text(run_dir / RESULT_FILE, json.dumps(data, indent=1))
    atomic_write_text(run_dir / COMPLETIONS_FILE, "# Base and tuned, greedy\n\n" + markdown_table(sides))
    failed = [v.model_dump() for v in verdicts if not v.passed]
    if failed:
        atomic_write_text(export_dir / FAILED_MARK, json.dumps({"failed": failed}, indent=1))
    return BenchReport(
        verdicts=verdicts,
        figures=figures(table),
        rows=table,
        completions=sides,
        seconds=result.seconds,
        base_cached=bool(result.base and result.base.cached),
    )


def score_run_folder(run_dir: str | Path, settings: BenchmarksSpec, base_dir: str | None) -> BenchResult:
    """`nightloom eval RUN --tasks` and the benchmark-run deployment: RUN/export (and a base beside it) on the
    settings' tasks, refused first (ValueError) for unknown tasks and data that needs the network; the raw
    result and the log go to RUN/eval/, the base's scores to the runs' cache."""
    from nightloom.benchmarks.catalog import task_errors

    include = str(Path(settings.include_path).resolve()) if settings.include_path else None
    if errs := task_errors(settings.tasks, include):
        raise ValueError("; ".join(reason for _, reason in errs))
    run_dir = Path(run_dir).resolve()
    return run_benchmarks(
        settings, str(run_dir / "export"), base_dir, run_dir / "eval", run_dir.parent / ".benchmarks", []
    )


__all__ = ["BenchReport", "markdown_table", "report", "run_stage", "score_run_folder", "table_rows"]
