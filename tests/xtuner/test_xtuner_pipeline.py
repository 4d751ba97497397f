"""`training_pipeline` with train.backend: xtuner runs every stage: shard → provision → plan → train → validate → record."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.xtuner_data import alpaca_rows


def test_full_pipeline_with_xtuner_backend(prefect_backend, xtuner_env, base_model, tmp_path):
    from flows.pipeline import training_pipeline
    from nightloom.ledger import Ledger
    from nightloom.metrics import read_metrics
    from nightloom.spec_load import parse_spec

    corpus = tmp_path / "alpaca.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in alpaca_rows(48)))
    spec = parse_spec(
        {
            "name": "xt-pipeline",
            "dataset": {
                "path": str(corpus),
                "text_field": "output",
                "keep_columns": ["instruction", "input", "output"],
            },
            "sharding": {"num_shards": 2, "output": str(tmp_path / "shards"), "balance_by": "rows", "tolerance": 0.5},
            "cluster": {"provider": "local", "nodes": 1, "gpus_per_node": 1, "gpu_type": "cpu"},
            "train": {
                "backend": "xtuner",
                "steps": 4,
                "seq_len": 128,
                "global_batch": 2,
                "lr": 1e-3,
                "warmup_steps": 1,
                "checkpoint_every": 2,
                "xtuner": {"method": "lora", "base_model": str(base_model)},
            },
            "validate": {"min_loss_drop": 0.0},
            "storage": {"root": str(tmp_path / "runs")},
            "ledger": {"url": f"sqlite:///{tmp_path / 'ledger.db'}"},
        }
    )
    state = training_pipeline(spec, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.status == "completed" and summary.shards == 2 and summary.steps == 4
    run_dir = Path(summary.run_dir)
    assert [m.step for m in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (run_dir / "model" / "config.json").is_file()  # converted (LoRA merged) Hugging Face model
    row = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}").get(summary.ledger_id)
    assert row.status == "succeeded" and row.final_loss == summary.last_loss
