"""The benchmark-run deployment's flow (prefect.yaml): any run folder's export and a base beside it on a local
lm-eval task folder, the base-vs-tuned rows returned and the `benchmarks` table artifact published."""

from __future__ import annotations

import asyncio

import yaml

from nightloom.benchmarks.compare import BenchRow
from tests.support.benchmarks import MC_TASK, qa_pairs, tiny_model, write_tasks


def test_benchmark_run_scores_a_run_folder_and_its_base(prefect_backend, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.benchmark import benchmark_run

    run_dir = tmp_path / "runs" / "r1"
    tiny_model(run_dir / "export", seed=0)
    (run_dir / "job.json").write_text("{}")
    base = tiny_model(tmp_path / "base", seed=1)
    folder = write_tasks(tmp_path / "tasks", qa_pairs(12))

    table = benchmark_run(str(run_dir), [MC_TASK], include_path=str(folder), base=str(base), limit=8)
    assert {r.metric for r in table} == {"acc", "acc_norm"} and all(isinstance(r, BenchRow) for r in table)
    for r in table:
        assert r.base is not None and r.samples == 8 and r.diff == r.tuned - r.base
    assert len(list((tmp_path / "runs" / ".benchmarks").glob("base-*.json"))) == 1  # the base, cached

    async def artifact():
        async with get_client() as client:
            return await client.read_latest_artifacts()

    latest = {a.key: a for a in asyncio.run(artifact())}
    rows = latest["benchmarks"].data
    rows = yaml.safe_load(rows) if isinstance(rows, str) else rows
    assert {(r["task"], r["metric"]) for r in rows} == {(MC_TASK, "acc"), (MC_TASK, "acc_norm")}, rows


def test_prefect_yaml_deploys_it():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    [d] = [
        d for d in yaml.safe_load((root / "prefect.yaml").read_text())["deployments"] if d["name"] == "benchmark-run"
    ]
    assert d["entrypoint"] == "flows/benchmark.py:benchmark_run"
