"""A gate that fails end to end: the flow run is Failed, the ledger row is failed with the verdict, the CLI exits 1,
and the artifacts (run summary, loss curve) are still published for the user to see why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from tests.support.harness import ROOT
from tests.support.pipeline import artifacts_of, demo_data


def _flow_run(run_id: str):
    """The pipeline's flow run whose id the run id ends with (make_run_id: name-stamp-<first 8 of the id>)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["training-pipeline"])))
    (fr,) = [r for r in runs if run_id.endswith(str(r.id)[:8])]
    return fr


def test_mfu_floor_of_99_percent_fails_flow_ledger_and_cli(prefect_backend, tmp_path):
    from nightloom.ledger import Ledger

    data = demo_data(tmp_path, steps=6, checkpoint_every=0)
    data["cluster"].update({"nodes": 1, "gpus_per_node": 2})  # the gate is under test, not the layout
    data["validate"]["mfu_floor"] = 0.99
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))

    # the real CLI in its own process, against this session's Prefect API
    env = {**os.environ, "PREFECT_API_URL": prefect_backend}
    r = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    assert "run failed: ValidationFailed" in r.stderr and "< floor 99.00%" in r.stderr, r.stderr[-3000:]

    (row,) = Ledger(data["ledger"]["url"]).list_runs()
    assert row.status == "failed" and not row.verified
    verdicts = {v.name: v for v in row.verdicts}
    assert [n for n, v in verdicts.items() if not v.passed] == ["mfu_floor"], row.verdicts
    floor = verdicts["mfu_floor"]
    assert floor.threshold == 0.99 and not floor.skipped and 0 < floor.measured < 0.99
    assert row.measured_mfu == floor.measured and row.final_loss is not None

    fr = _flow_run(row.run_id)
    assert fr.state.is_failed(), fr.state
    assert "mfu_floor" in (fr.state.message or ""), fr.state.message

    arts = {a.key: a for a in artifacts_of(fr.id) if a.key}
    assert {"run-summary", "loss-curve", "plan"} <= set(arts), set(arts)
    table = arts["run-summary"].data
    rows = {r["field"]: r["value"] for r in (json.loads(table) if isinstance(table, str) else table)}
    assert rows["gate mfu_floor"].startswith("FAIL: ")
    assert rows["gate mfu_vs_plan"].startswith("not gated: ")  # skipped, never "pass"
    assert rows["gate loss_drop"].startswith("pass: ")
    assert "data:image/png;base64," in arts["loss-curve"].data
