"""Benchmark tasks: lm-eval on the run's export and its base after training, on its nodes
(nightloom/benchmarks/stage.py), the base-vs-tuned and completions table artifacts, its verdicts and ledger figures
joined to the validation outcome; and on any run folder (the benchmark-run deployment)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from nightloom.benchmarks.compare import BenchRow, rows
from nightloom.benchmarks.launch import node_runner
from nightloom.benchmarks.stage import BenchReport, run_stage, score_run_folder, table_rows
from nightloom.provision.base import Cluster, Provider
from nightloom.spec import RunSpec
from nightloom.spec.benchmarks import BenchmarksSpec
from nightloom.train.job import TrainResult
from tasks.validate import ValidationOutcome


def _local_dir(path: str | None) -> str | None:
    return path if path and "://" not in path and Path(path).is_dir() else None


@task(name="benchmarks", cache_policy=NO_CACHE)
def benchmark_task(
    spec: RunSpec, run_dir: Path, result: TrainResult, provider: Provider, cluster: Cluster
) -> BenchReport:
    """Score the export (and the base, once per base) on validate.benchmarks while the nodes are held: on the first
    node through its provider's shell where the nodes are other machines (ssh, slurm), else here."""
    log = get_run_logger()
    settings = spec.validate_.benchmarks
    export = result.export_dir if result.stopped == "completed" else None
    remote = provider.capabilities.remote_nodes and cluster.nodes
    runner = node_runner(provider, cluster, cluster.nodes[0]) if remote else None
    rep = run_stage(settings, Path(run_dir), export, _local_dir(spec.model.weights), spec.sharding.output, runner)
    for r in rep.rows:
        base = "n/a" if r.base is None else f"{r.base:.4f}"
        diff = "" if r.diff is None else f" ({r.diff:+.4f})"
        log.info("bench %s %s: base %s -> tuned %.4f%s", r.task, r.metric, base, r.tuned, diff)
    for v in rep.verdicts:
        (log.info if v.passed else log.error)("gate %-12s %s: %s", v.name, v.label, v.reason)
    if rep.rows:
        where = f" on {cluster.nodes[0].name}" if remote else ""
        cached = " (base cached)" if rep.base_cached else ""
        desc = f"Base vs tuned, lm-evaluation-harness{where}, {rep.seconds:.1f} s{cached}"
        create_table_artifact(key="benchmarks", table=table_rows(rep.rows), description=desc)
    if rep.completions:
        create_table_artifact(key="completions", table=rep.completions, description="Base vs tuned, greedy")
    return rep


def with_benchmarks(outcome: ValidationOutcome, rep: BenchReport | None) -> ValidationOutcome:
    """The validation outcome with the benchmark gates among its verdicts and the scores among its figures, so
    the ledger, the summary and the run's status see them."""
    if rep is None:
        return outcome
    return outcome.model_copy(
        update={"verdicts": [*outcome.verdicts, *rep.verdicts], "figures": [*outcome.figures, *rep.figures]}
    )


@task(name="benchmark-run-folder", cache_policy=NO_CACHE)
def benchmark_folder_task(run_dir: str, settings: BenchmarksSpec, base_dir: str | None) -> list[BenchRow]:
    """Any run folder's export (and a base beside it) on lm-eval tasks: the base-vs-tuned table artifact."""
    result = score_run_folder(run_dir, settings, base_dir)
    table = rows(result)
    cached = " (base cached)" if result.base and result.base.cached else ""
    desc = f"{run_dir}: base vs tuned, lm-evaluation-harness, {result.seconds:.1f} s{cached}"
    create_table_artifact(key="benchmarks", table=table_rows(table), description=desc)
    for r in table:
        get_run_logger().info("bench %s %s: %s", r.task, r.metric, table_rows([r])[0])
    return table
