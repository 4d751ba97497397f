"""The alpaca-style fine-tuning sample: built on first use, deterministic, with the alpaca map function's columns."""

from __future__ import annotations

import json

import pytest

from nightloom.sharding.corpus import ensure_sample_corpus


@pytest.mark.slow
def test_alpaca_sample_is_deterministic_with_alpaca_columns(tmp_path):
    a = ensure_sample_corpus(tmp_path / "a" / "alpaca.jsonl", kind="alpaca")
    b = ensure_sample_corpus(tmp_path / "b" / "alpaca.jsonl", kind="alpaca")
    assert a.read_bytes() == b.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert 500 < len(rows) <= 2000
    assert all(set(r) == {"id", "instruction", "input", "output"} for r in rows)
    assert all(r["instruction"] == f"Explain what `{r['id']}` does." and len(r["output"]) >= 40 for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)


def test_demo_spec_builds_its_sample_on_first_use():
    from pathlib import Path

    from nightloom.spec.load import load_spec

    spec = load_spec(Path(__file__).resolve().parents[3] / "deployments" / "xtuner-lora-demo.yaml")
    assert spec.dataset.sample and spec.dataset.sample_kind == "alpaca"
    assert spec.train.xtuner.build_tiny_base_model
    assert set(spec.dataset.keep_columns) >= {"instruction", "input", "output"}
    assert (
        spec.validate_.min_loss_drop >= 0.02
    )  # a gate at 0% is no gate (the run it gates: tests/xtuner/test_xtuner_pipeline.py)
