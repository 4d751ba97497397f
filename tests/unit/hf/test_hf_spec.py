"""model.config / model.weights / train.export in the spec: resolved, checked before anything is rented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nightloom.finetune.xtuner_plan import _hf_flops_per_token
from nightloom.hf.random_model import build_random_model, ensure_demo_weights
from nightloom.parallel import ParallelPlan
from nightloom.spec import SpecError, TrainSpec
from nightloom.spec.load import load_spec, parse_spec
from nightloom.train.job import TrainJob

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "deployments" / "continue-pretrain-demo.yaml"
BASE = {"name": "t", "dataset": {"path": "x.jsonl", "sample": True}}


def _spec(tmp_path, model, **extra):
    return parse_spec({**BASE, "model": model, **extra}, base_dir=tmp_path)


def test_demo_spec_is_valid_before_and_after_its_weights_exist(tmp_path):
    data = yaml.safe_load(DEMO.read_text())
    data["model"]["weights"] = str(tmp_path / "demo")
    spec = parse_spec(data, base_dir=DEMO.parent)  # weights not built yet: allowed with build_demo_weights
    assert spec.model.config == str(tmp_path / "demo" / "config.json")
    ensure_demo_weights(spec.model.weights)
    spec = parse_spec(data, base_dir=DEMO.parent)
    assert (tmp_path / "demo" / "model.safetensors.index.json").is_file()
    assert spec.train.export == "hf" and load_spec(DEMO).model.build_demo_weights


def test_weights_folder_errors(tmp_path):
    with pytest.raises(SpecError, match=r"model.weights: folder not found"):
        _spec(tmp_path, {"config": str(_config(tmp_path)), "weights": "nowhere"})
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=r"model.weights: no \*.safetensors files"):
        _spec(tmp_path, {"config": str(_config(tmp_path)), "weights": "empty"})
    with pytest.raises(SpecError, match=r"model.config: required when model.weights is an s3:// prefix"):
        _spec(tmp_path, {"weights": "s3://bucket/llama"})


def _config(tmp_path, **change):
    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        **change,
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_config_with_unsupported_math_is_a_spec_error(tmp_path):
    _config(tmp_path, rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(SpecError, match=r"model.config: .*config.json: rope_scaling.rope_type: 'longrope'"):
        _spec(tmp_path, {"config": "config.json"})
    _config(tmp_path)
    assert _spec(tmp_path, {"config": str(tmp_path)}).model.config == str(tmp_path)


def test_export_auto_follows_the_model_source(tmp_path):
    src = build_random_model(tmp_path / "w", "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    spec = _spec(tmp_path, {"weights": "w"})
    assert spec.model.config == str(src / "config.json") and spec.train.export == "auto"

    def job(hf_config, export="auto"):
        from nightloom.catalog import get_model

        return TrainJob(
            run_id="r",
            run_dir=str(tmp_path),
            model=(get_model("tiny")),
            plan=ParallelPlan(),
            train=TrainSpec(export=export),
            manifest="m",
            hf_config=hf_config,
        )

    assert job(spec.model.config).export_format == "hf"
    assert job(None).export_format == "none" and job(None, "hf").export_format == "hf"
    assert job(spec.model.config, "none").export_format == "none"


def test_job_json_round_trips_the_model_shape_with_rope_scaling(tmp_path):
    """TrainJob carries the resolved ModelShape itself: every field survives job.json (no mirror to drift)."""
    from nightloom.hf.config import shape_from_hf_config

    p = _config(tmp_path, rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True)
    shape = shape_from_hf_config(p).padded_for_tp(3)
    job = TrainJob(run_id="r", run_dir=str(tmp_path), model=shape, plan=ParallelPlan(), train=TrainSpec(), manifest="m")
    again = TrainJob.model_validate_json(job.model_dump_json()).model
    assert (
        again == shape
        and again.rope_scaling.factor == 2.0
        and again.o_bias
        and again.padded_vocab == shape.padded_vocab
    )


def test_job_json_written_before_the_shape_record_still_loads(tmp_path):
    """A job.json of an earlier release (its model section had no published_params / padded_vocab) still reads:
    export and eval of old run folders open it."""
    old = {
        "run_id": "r",
        "run_dir": str(tmp_path),
        "model": {
            "name": "tiny", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 256,
            "max_seq": 512, "tied_embeddings": False, "gated_mlp": True, "norm_eps": 1e-5, "rope_theta": 10000.0,
            "explicit_head_dim": None, "rope_scaling": {"kind": "linear", "factor": 2.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "qkv_bias": False, "o_bias": False,
            "mlp_bias": False, "sliding_window": None, "arch": "llama",
        },
        "plan": {},
        "train": {},
        "manifest": "m",
    }  # fmt: skip
    job = TrainJob.model_validate(old)
    assert job.model.layers == 4 and job.model.rope_scaling.factor == 2.0 and job.model.padded_vocab == 0
    assert not job.model.qk_norm  # written before qwen3: no q/k norms


def test_qwen3_weights_resolve_and_its_sliding_window_is_refused_in_the_spec(tmp_path):
    """A qwen3 folder is a model like any other (shape with q/k norms, export auto = hf); a config that turns its
    sliding window on fails the spec naming the field, before anything is rented."""
    from nightloom.model_resolver import model_shape

    build_random_model(
        tmp_path / "w", "qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256,
    )  # fmt: skip
    spec = _spec(tmp_path, {"weights": "w"})
    shape = model_shape(spec.model)
    assert shape.arch == "qwen3" and shape.qk_norm and shape.head_dim == 16
    job = TrainJob(run_id="r", run_dir=str(tmp_path), model=shape, plan=ParallelPlan(), train=TrainSpec(), manifest="m")
    assert TrainJob.model_validate_json(job.model_dump_json()).model == shape
    _config(tmp_path, model_type="qwen3", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    with pytest.raises(SpecError, match=r"model.config: .*config.json: use_sliding_window: true is not supported"):
        _spec(tmp_path, {"config": "config.json"})


def test_xtuner_flops_read_gpt2_configs(tmp_path):
    """The one parser: finetune/run.py's copy returned None on GPT-2 keys."""
    cfg = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 300, "n_positions": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert _hf_flops_per_token(tmp_path, 64) > 0
    assert _hf_flops_per_token(tmp_path / "missing", 64) is None


def test_param_count_covers_head_dim_and_biases(tmp_path):
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.perf import count_params
    from nightloom.train.model import build_model, param_count

    for change in ({"head_dim": 24, "attention_bias": True, "mlp_bias": True}, {"model_type": "qwen2"}):
        shape = shape_from_hf_config(_config(tmp_path, **change))
        assert count_params(shape) == param_count(build_model(shape, seq_len=16)), change
