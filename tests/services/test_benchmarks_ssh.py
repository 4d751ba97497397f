"""Benchmarks on a rented node: the lm-eval process runs on the SSH cluster's first node through the provider's
shell (nightloom.benchmarks.launch.node_runner), in the shared run folder (the parity with lm-eval by hand is
tests/unit/benchmarks/test_parity.py)."""

from __future__ import annotations

from nightloom.benchmarks.launch import node_runner, run_benchmarks
from nightloom.provision.ssh import SSHProvider
from nightloom.spec.benchmarks import BenchmarksSpec
from tests.support.benchmarks import MC_TASK, qa_pairs, tiny_model, write_tasks
from tests.support.ssh import make_spec


def test_benchmarks_run_on_the_first_node(sshenv, tmp_path):
    export = tiny_model(tmp_path / "runs" / "r" / "export")
    folder = write_tasks(tmp_path / "tasks", qa_pairs(8))
    settings = BenchmarksSpec(tasks=[MC_TASK], include_path=str(folder), base=False)
    p = SSHProvider(make_spec(sshenv, tmp_path / "work", nodes=1))
    c = p.acquire()
    try:
        remote = run_benchmarks(
            settings, str(export), None, tmp_path / "runs" / "r", tmp_path / "cache", [], node_runner(p, c, c.nodes[0])
        )
    finally:
        p.release(c)
    scores = {(x.task, x.metric): x for x in remote.tuned.scores}
    assert set(scores) == {(MC_TASK, "acc"), (MC_TASK, "acc_norm")}
    assert all(0 <= x.value <= 1 and x.samples == 8 for x in scores.values()), scores
    assert f"[{c.nodes[0].name}]" in (tmp_path / "runs" / "r" / "benchmarks.log").read_text()  # it ran there
