"""The continue-pretrain demo through the whole flow: Hugging Face weights in (FSDP2 shards), train, export."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_continue_pretrain_demo_exports_a_model_transformers_loads(prefect_backend, tmp_path):
    import transformers

    from flows.pipeline import training_pipeline
    from nightloom.metrics import read_metrics

    data = yaml.safe_load((ROOT / "deployments" / "continue-pretrain-demo.yaml").read_text())
    data["model"]["weights"] = str(tmp_path / "demo-llama")
    data["dataset"]["path"] = str(ROOT / "datasets" / "sample" / "corpus.jsonl")
    data["sharding"]["output"] = str(tmp_path / "shards")
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    data["train"].update({"steps": 6, "checkpoint_every": 3})
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    state = training_pipeline(str(spec), return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    run_dir = Path(summary.run_dir)
    assert summary.export_dir == str(run_dir / "export")
    assert len(read_metrics(run_dir / "metrics.jsonl")) == 6
    model, info = transformers.AutoModelForCausalLM.from_pretrained(summary.export_dir, output_loading_info=True)
    assert all(not v for v in info.values()), info
    assert model.config.vocab_size == 256 and model.config.num_hidden_layers == 4
    # trained from the demo checkpoint, not from a fresh init: a few small steps away from its weights
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "demo-llama")
    a = model.model.layers[0].self_attn.q_proj.weight.flatten()
    b = start.model.layers[0].self_attn.q_proj.weight.flatten()
    assert not a.equal(b) and float(a @ b / (a.norm() * b.norm())) > 0.5
