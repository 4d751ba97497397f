"""The XTuner branch of the train stage: interruptions its recovery reports go to the ledger row, and the
rental follows the nodes the run ended on (teardown must reach a replacement allocation). The XTuner run
itself is replaced by its result here; the real runs are tests/services/test_xtuner_remote.py."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

from nightloom.finetune.run import XTunerInterruption, XTunerResult
from nightloom.ledger import Ledger
from nightloom.parallel import ParallelPlan
from nightloom.provision.base import Cluster, Node


def _cluster(job_id: str, names: list[str]) -> Cluster:
    nodes = [Node(name=n, address=n, slots=1) for n in names]
    return Cluster(
        provider="slurm", name="c", nodes=nodes, master_addr=names[0], master_port=1, handle={"job_id": job_id}
    )


def test_xtuner_interruptions_reach_the_ledger_and_the_rental(prefect_backend, tmp_path, monkeypatch):
    import flows.stages as stages
    from tests.support.xtuner_data import make_spec

    spec = make_spec(tmp_path, tmp_path / "base", tmp_path / "shards")
    spec = spec.model_copy(update={"ledger": spec.ledger.model_copy(update={"url": f"sqlite:///{tmp_path}/l.db"})})
    with Ledger(spec.ledger.url) as lg:
        lg.start_run(
            run_id="r1",
            spec_hash="h",
            name="xt",
            model="m",
            cluster="c",
            provider="slurm",
            gpu_type="cpu",
            world_size=2,
        )
    first, after = _cluster("7", ["n1", "n2"]), _cluster("8", ["n1"])
    at = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)
    result = XTunerResult(
        steps_done=6,
        total_steps=6,
        stopped="completed",
        final_loss=5.4,
        tokens=100,
        wall_s=30.0,
        metrics_path=str(tmp_path / "metrics.jsonl"),
        config_path="c.py",
        interruptions=[
            XTunerInterruption(
                attempt=0, kind="node", detail="n2: torch", at=at, recovery_s=3.0, world_before=2, world_after=1
            )
        ],
        cluster=after,
    )
    monkeypatch.setattr(stages, "xtuner_train_task", lambda *a, **k: result)
    rental = stages.Rental(provider=None, cluster=first, first=first, started=at)
    job = SimpleNamespace(run_dir=str(tmp_path), run_id="r1", plan=ParallelPlan())
    out = stages.train_stage(spec, rental, job)
    assert out.interruptions == 1 and out.recovery_s == 3.0 and out.cluster == after
    assert rental.cluster.handle == {"job_id": "8"} and {n.name for n in rental.cluster.nodes} == {"n1", "n2"}
    with Ledger(spec.ledger.url) as lg:
        row = lg.get("r1")
    assert row.interruption_count == 1 and row.recovery_s == 3.0
    assert row.interruptions[0].kind == "node" and row.interruptions[0].detail == "n2: torch"


def test_interruptions_of_a_run_that_gives_up_reach_the_ledger(prefect_backend, tmp_path, monkeypatch):
    """Recovery gave up (out of attempts): the XTuner task fails, and the interruptions it saw (the error's
    `events`, through a real Prefect task) are in the ledger row before the failure propagates."""
    import pytest
    from prefect import task

    import flows.stages as stages
    from nightloom.finetune.launcher import XTunerLaunchError
    from nightloom.recovery import Event
    from tests.support.xtuner_data import make_spec

    spec = make_spec(tmp_path, tmp_path / "base", tmp_path / "shards")
    spec = spec.model_copy(update={"ledger": spec.ledger.model_copy(update={"url": f"sqlite:///{tmp_path}/l.db"})})
    with Ledger(spec.ledger.url) as lg:
        lg.start_run(
            run_id="r2", spec_hash="h", name="xt", model="m", cluster="c", provider="ssh", gpu_type="cpu", world_size=2
        )
    at = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)
    err = XTunerLaunchError("train failed (exit -9)")
    err.events = [
        Event(
            attempt=0,
            kind="node",
            detail="n2: torch; resumed from iter_4.pth on n1",
            at=at,
            recovery_s=2.0,
            world_before=2,
        ),
        Event(attempt=1, kind="node", detail="n1: killed; gave up: out of attempts", at=at, world_before=1),
    ]

    @task
    def failing(*a, **k):
        raise err

    monkeypatch.setattr(stages, "xtuner_train_task", failing)
    first = _cluster("7", ["n1", "n2"])
    rental = stages.Rental(provider=None, cluster=first, first=first, started=at)
    job = SimpleNamespace(run_dir=str(tmp_path), run_id="r2", plan=ParallelPlan())
    with pytest.raises(XTunerLaunchError, match="train failed"):
        stages.train_stage(spec, rental, job)
    with Ledger(spec.ledger.url) as lg:
        row = lg.get("r2")
    assert row.interruption_count == 2
    assert [i.detail for i in row.interruptions] == [e.detail for e in err.events]
