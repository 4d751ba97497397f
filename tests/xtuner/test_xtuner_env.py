"""The XTuner node env: found warm by its hash, pinned as the lock says, and agreeing with nightloom's tables."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from nightloom.finetune import config as xcfg
from nightloom.finetune.env import ensure_env, env_key, probe
from nightloom.spec import RunSpec

REPO = Path(__file__).resolve().parents[2]


def test_warm_env_is_found_not_rebuilt(xtuner_env, capsys):
    t0 = time.monotonic()
    again = ensure_env(profile="cpu", log=lambda s: None)
    warm_s = time.monotonic() - t0
    assert not again.created and again.path == xtuner_env.path and again.key == env_key("cpu")
    print(f"warm ensure_env: {warm_s:.1f} s")


def test_env_matches_pins_and_tables(xtuner_env):
    info = probe(xtuner_env.python)
    v = info["versions"]
    assert v["xtuner"] == "0.2.0" and v["transformers"] == "4.48.0" and v["torch"].startswith("2.13.0")
    assert int(v["datasets"].split(".")[0]) < 4
    assert {m.name for m in xcfg.MAP_FNS.values()} <= set(info["map_fns"])
    assert set(info["templates"]) == xcfg.PROMPT_TEMPLATES


def test_sample_deployment_spec_parses():
    data = yaml.safe_load((REPO / "deployments" / "xtuner-lora-demo.yaml").read_text())
    spec = RunSpec.model_validate(data)
    assert spec.train.backend == "xtuner" and spec.train.xtuner.method == "lora"
    need = xcfg.resolve_map_fn(spec.train.xtuner.map_fn).columns
    assert set(need) <= {*spec.dataset.keep_columns, spec.dataset.text_field}  # the shards carry what it reads
    xcfg.check_template(spec.train.xtuner.template)
