"""Base and tuned side by side: one row per task and metric (base, tuned, diff, stderr), the benchmark gates'
verdicts, the ledger's figures (`bench/TASK/METRIC`) and the side-by-side completions."""

from __future__ import annotations

from nightloom.benchmarks.records import BenchResult, Score
from nightloom.gates import Verdict
from nightloom.ledger.records import Figure
from nightloom.records import FrozenRecord
from nightloom.spec.benchmarks import BenchGateSpec, BenchmarksSpec

FIGURE_PREFIX = "bench/"


class BenchRow(FrozenRecord):
    """One task's metric, base and tuned; diff = tuned - base."""

    task: str
    metric: str
    tuned: float
    base: float | None = None
    stderr: float | None = None  # the tuned score's
    base_stderr: float | None = None
    samples: int | None = None

    @property
    def diff(self) -> float | None:
        return None if self.base is None else self.tuned - self.base


def rows(result: BenchResult) -> list[BenchRow]:
    """Every metric the tuned model scored, with the base's beside it where measured."""
    base: dict[tuple[str, str], Score] = {(s.task, s.metric): s for s in (result.base.scores if result.base else [])}
    out = []
    for s in result.tuned.scores:
        b = base.get((s.task, s.metric))
        out.append(
            BenchRow(
                task=s.task,
                metric=s.metric,
                tuned=s.value,
                base=b.value if b else None,
                stderr=s.stderr,
                base_stderr=b.stderr if b else None,
                samples=s.samples,
            )
        )
    return out


def figures(table: list[BenchRow]) -> list[Figure]:
    """The ledger's figures: Figure(name="bench/TASK/METRIC", value=tuned, stderr, base)."""
    return [
        Figure(name=f"{FIGURE_PREFIX}{r.task}/{r.metric}", value=r.tuned, stderr=r.stderr, base=r.base) for r in table
    ]


def _verdict(gate: BenchGateSpec, row: BenchRow | None) -> list[Verdict]:
    name = f"bench:{gate.task}/{gate.metric}"
    if row is None:
        return [Verdict(name=name, passed=False, reason=f"lm-eval reported no {gate.metric!r} for task {gate.task!r}")]
    out = []
    where = f"{gate.task} {gate.metric}"
    if gate.min is not None:
        ok = row.tuned >= gate.min
        out.append(
            Verdict(
                name=name,
                passed=ok,
                measured=row.tuned,
                threshold=gate.min,
                reason=f"{where} {row.tuned:.4f} {'>=' if ok else '<'} floor {gate.min:g}",
            )
        )
    for bound, kind in ((gate.min_gain, "min_gain"), (gate.max_drop, "max_drop")):
        if bound is None:
            continue
        if row.diff is None:
            out.append(Verdict(name=f"{name}:{kind}", passed=False, reason=f"{where}: no base score to compare"))
            continue
        ok = row.diff >= bound if kind == "min_gain" else -row.diff <= bound
        said = (
            f"gain {row.diff:+.4f} {'>=' if ok else '<'} {bound:g}"
            if kind == "min_gain"
            else f"drop {-row.diff:.4f} {'<=' if ok else '>'} {bound:g}"
        )
        out.append(
            Verdict(
                name=f"{name}:{kind}",
                passed=ok,
                measured=row.diff,
                threshold=bound,
                reason=f"{where}: base {row.base:.4f} -> tuned {row.tuned:.4f}, {said}",
            )
        )
    return out


def check_benchmarks(settings: BenchmarksSpec, table: list[BenchRow]) -> list[Verdict]:
    """A verdict per gate bound (floor, least gain, most drop); one skipped verdict when no gate is set."""
    if not settings.gates:
        return [Verdict(name="benchmarks", passed=True, skipped=True, reason="no benchmark gates (scores reported)")]
    by = {(r.task, r.metric): r for r in table}
    return [v for g in settings.gates for v in _verdict(g, by.get((g.task, g.metric)))]


def _f(x: float | None, spec: str = ".4f") -> str:
    return "" if x is None else format(x, spec)


def table_rows(table: list[BenchRow]) -> list[dict]:
    """The artifact's and the summary's rows: task, metric, base, tuned, diff, stderr."""
    return [
        {
            "task": r.task,
            "metric": r.metric,
            "base": _f(r.base),
            "tuned": _f(r.tuned),
            "diff": _f(r.diff, "+.4f"),
            "stderr": _f(r.stderr),
        }
        for r in table
    ]


def completion_rows(result: BenchResult) -> list[dict]:
    """prompt, base, tuned: the two models' greedy completions side by side."""
    base = {c.prompt: c.text for c in (result.base.completions if result.base else [])}
    return [{"prompt": c.prompt, "base": base.get(c.prompt, ""), "tuned": c.text} for c in result.tuned.completions]
