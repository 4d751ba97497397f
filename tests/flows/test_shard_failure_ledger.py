"""A run that fails in the shard stage (a bad record the pre-scan did not see: the flow is started directly, as a
deployment or a remote dataset would) still gets its ledger row: failed, with the error and its fix."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.support.pipeline import demo_data


def test_a_run_failing_in_the_shard_stage_has_a_failed_ledger_row(prefect_backend, tmp_path):
    from flows.pipeline import training_pipeline
    from nightloom.ledger import Ledger
    from nightloom.sharding.errors import BadInputError

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in ({"text": "one"}, {"body": "no text"}, {"text": "two"})))
    data = demo_data(tmp_path)
    data["dataset"] = {"path": str(corpus)}
    data["model"]["tokenizer"] = "bytes"  # nothing to train: the run stops at the scan
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))

    with pytest.raises(BadInputError, match="corpus.jsonl:2: missing field 'text'"):
        training_pipeline(str(spec))

    (row,) = Ledger(data["ledger"]["url"]).list_runs()
    assert row.status == "failed", row
    assert row.reason.startswith(f"BadInputError: {corpus}:2: missing field 'text'; fix the record"), row.reason
    assert "sharding.on_error: skip" in row.reason and row.finished_at is not None
