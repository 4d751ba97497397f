"""The embedded demo spec, shrunk for tests (outputs in tmp_path, a short run), and Prefect API lookups."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.harness import ROOT
from tests.support.prefect_server import client


def demo_data(tmp_path: Path, **train) -> dict:
    """The demo spec as a mapping, with its outputs in tmp_path and a short training run."""
    data = yaml.safe_load((ROOT / "deployments" / "local-demo.yaml").read_text())
    data["dataset"]["path"] = str(ROOT / "datasets" / "sample" / "corpus.jsonl")
    data["sharding"]["output"] = str(tmp_path / "shards")
    data["model"]["tokenizer"]["path"] = str(tmp_path / "tokenizer")  # the demo's BPE, trained on first use
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    data["train"].update({"steps": 12, "checkpoint_every": 6, **train})
    return data


def small_demo(tmp_path: Path, **train) -> Path:
    """demo_data written as a spec file."""
    p = tmp_path / "spec.yaml"
    tmp_path.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(demo_data(tmp_path, **train)))
    return p


def artifacts_of(flow_run_id) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with client() as c:
        return c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
