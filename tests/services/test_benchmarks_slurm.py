"""Benchmarks on a Slurm allocation: the lm-eval process runs on the allocation's first node as an `srun --overlap`
step (the provider's shell, nightloom.benchmarks.launch.node_runner), in the shared run folder (the SSH path is
test_benchmarks_ssh.py; base and tuned in one process and the base's cache, test_bench_regression_flow.py)."""

from __future__ import annotations

import pytest

from nightloom.benchmarks.launch import node_runner, run_benchmarks
from nightloom.provision.slurm import SlurmProvider
from nightloom.spec import ClusterSpec, DatasetSpec, RunSpec, SlurmSpec, StorageSpec
from nightloom.spec.benchmarks import BenchmarksSpec
from tests.support.benchmarks import MC_TASK, qa_pairs, tiny_model, write_tasks
from tests.support.ssh import PY

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]


def test_benchmarks_run_on_the_allocations_first_node(slurm, tmp_path):
    export = tiny_model(tmp_path / "runs" / "r" / "export")
    folder = write_tasks(tmp_path / "tasks", qa_pairs(8))
    settings = BenchmarksSpec(tasks=[MC_TASK], include_path=str(folder), base=False)
    spec = RunSpec(
        name="bench-slurm",
        dataset=DatasetSpec(path="/tmp"),
        storage=StorageSpec(root=str(tmp_path / "runs")),
        cluster=ClusterSpec(provider="slurm", nodes=1, gpus_per_node=1, slurm=SlurmSpec(partition="debug")),
    )
    p = SlurmProvider(spec, python=PY)
    c = p.acquire()
    try:
        run = node_runner(p, c, c.nodes[0])
        got = run_benchmarks(settings, str(export), None, tmp_path / "runs" / "r", tmp_path / "cache", [], run)
    finally:
        p.release(c)
    scores = {(x.task, x.metric): x for x in got.tuned.scores}
    assert set(scores) == {(MC_TASK, "acc"), (MC_TASK, "acc_norm")} and got.base is None
    assert all(0 <= x.value <= 1 and x.samples == 8 for x in scores.values()), scores
    log = (tmp_path / "runs" / "r" / "benchmarks.log").read_text()
    assert f"[{c.nodes[0].name}]" in log and "lm-eval's hf backend" in log  # it ran there, on the node's CPU
