"""XTuner backend end to end on CPU, offline, in its own env: LoRA (1 rank), full FT (2 ranks, gloo), resume,
convert + merge round trip, and an empty processed dataset caught before launch."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from nightloom.finetune.config import XTunerConfigError
from nightloom.finetune.logs import launch_dirs, parse_launch
from nightloom.finetune.run import run_xtuner
from nightloom.metrics import read_metrics
from nightloom.spec.tracking import TrackSpec
from tests.support.trackers import tensorboard_scalars
from tests.support.xtuner_data import alpaca_rows, make_spec, run_in_env, write_shards


def QUIET(s):
    return None


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"), alpaca_rows(48))


@pytest.fixture(scope="module")
def lora_run(xtuner_env, base_model, shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    spec = make_spec(tmp, base_model, shards, method="lora", steps=4, checkpoint_every=2, global_batch=2)
    spec = spec.model_copy(update={"track": TrackSpec.model_validate(["tensorboard"])})  # its steps to a tracker
    result = run_xtuner(spec, shards, tmp / "run", log=QUIET, env=xtuner_env)
    return spec, result, tmp


def test_lora_one_rank(lora_run):
    spec, r, tmp = lora_run
    assert r.steps_done == 4 and r.total_steps == 4 and r.stopped == "completed" and r.profile == "cpu"
    steps = read_metrics(r.metrics_path)
    assert [m.step for m in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(m.loss) and m.tokens == 2 * 128 and m.step_time_s > 0 for m in steps)
    assert steps[1].lr == pytest.approx(spec.train.lr)  # warmup (1 step) ends exactly at the spec's lr
    assert steps[3].lr < steps[2].lr < steps[1].lr  # then cosine decay
    assert r.final_loss == steps[-1].loss and r.tokens == 4 * 256
    assert Path(r.last_checkpoint).name == "iter_4.pth"
    assert r.processed_rows > 0 and r.processed_tokens > 0
    assert (Path(r.adapter_dir) / "adapter_config.json").is_file()
    assert (Path(r.model_dir) / "config.json").is_file() and r.published == r.model_dir
    saved = json.loads((tmp / "run" / "result.json").read_text())
    assert saved["steps_done"] == 4 and saved["metrics_path"] == r.metrics_path
    assert "train.log" in {p.name for p in (tmp / "run" / "xtuner" / "logs").iterdir()}
    # track: the steps reached the tracker under a native run's names, with metrics.jsonl's values (float32 there)
    for key in ("loss", "lr", "grad_norm"):
        got = tensorboard_scalars(tmp / "run" / "tensorboard", f"train/{key}")
        assert got == pytest.approx({m.step: getattr(m, key) for m in steps}, rel=1e-6)


def test_convert_merge_round_trip(lora_run, base_model, xtuner_env):
    """Merged model == base + adapter merged by PEFT in memory (both fp16-rounded), and != base: LoRA trained."""
    _, r, _ = lora_run
    out = run_in_env(
        xtuner_env,
        f"""
import torch, json
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel
tok = AutoTokenizer.from_pretrained({str(r.model_dir)!r})
ids = tok("what is the sum of a list", return_tensors="pt").input_ids
def logits(dtype, adapter):
    m = AutoModelForCausalLM.from_pretrained({str(base_model)!r}, torch_dtype=dtype)
    if adapter:
        m = PeftModel.from_pretrained(m, {str(r.adapter_dir)!r}).merge_and_unload()
    return m.float().eval()(ids).logits
with torch.no_grad():
    lb = logits(torch.float32, False)
    lp32 = logits(torch.float32, True)
    lp16 = logits(torch.float16, True)  # what xtuner's merge tool does: fp16 base, merge, save
    lm = AutoModelForCausalLM.from_pretrained({str(r.model_dir)!r}, torch_dtype=torch.float32).eval()(ids).logits
d = lambda a, b: (a - b).abs().max().item()
print(json.dumps({{"vs_peft16": d(lm, lp16), "vs_peft32": d(lm, lp32), "vs_base": d(lm, lb)}}))
""",
    )
    d = json.loads(out.strip().splitlines()[-1])
    assert d["vs_peft16"] < 1e-6, d  # the saved merged model is exactly base ⊕ adapter
    assert d["vs_base"] > 1e-3, d  # LoRA changed the model
    assert d["vs_peft32"] < 0.05 * d["vs_base"], d  # fp16 storage error is small next to the LoRA delta


def test_resume_continues_from_checkpoint(lora_run, xtuner_env):
    """Drop the last checkpoint (a crash after step 2), resume: steps 3-4 come from a new launch that starts at
    step 3 and reproduces the uninterrupted losses."""
    spec, r, tmp = lora_run
    src, dst = tmp / "run", tmp / "resumed"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("export", "result.json"))
    work = dst / "xtuner" / "work_dir"
    (work / "iter_4.pth").unlink()
    (work / "last_checkpoint").write_text(str(work / "iter_2.pth"))
    before = {m.step: m.loss for m in read_metrics(r.metrics_path)}
    r2 = run_xtuner(spec, Path(spec.sharding.output), dst, log=QUIET, env=xtuner_env, convert=False)
    newest = parse_launch(launch_dirs(work)[-1])
    assert [int(x["step"]) for x in newest] == [3, 4], "resume restarted from scratch instead of iter_2"
    after = read_metrics(r2.metrics_path)
    assert [m.step for m in after] == [1, 2, 3, 4]
    assert after[2].gap and not after[3].gap and after[2].attempt == 1
    for m in after[2:]:
        assert m.loss == pytest.approx(before[m.step], rel=1e-5, abs=1e-6)
    assert r2.stage_s["prepare_s"] < r.stage_s["prepare_s"]  # processed dataset reused (same inputs)


def test_full_finetune_two_ranks_gloo(xtuner_env, base_model, shards, tmp_path):
    spec = make_spec(tmp_path, base_model, shards, method="full", ranks=2, steps=3, global_batch=4, checkpoint_every=3)
    r = run_xtuner(spec, shards, tmp_path / "run", log=QUIET, env=xtuner_env)
    steps = read_metrics(r.metrics_path)
    assert [m.step for m in steps] == [1, 2, 3] and all(m.tokens == 4 * 128 for m in steps)
    assert r.adapter_dir is None and r.model_dir
    assert "--nproc-per-node=2" in (tmp_path / "run" / "xtuner" / "logs" / "train.log").read_text()
    out = run_in_env(
        xtuner_env,
        f"""
import torch, json
from transformers import AutoModelForCausalLM
a = AutoModelForCausalLM.from_pretrained({str(base_model)!r}).state_dict()
b = AutoModelForCausalLM.from_pretrained({str(r.model_dir)!r}).state_dict()
print(json.dumps({{"keys_equal": sorted(a) == sorted(b),
                   "changed": max((a[k] - b[k]).abs().max().item() for k in a)}}))
""",
    )
    d = json.loads(out.strip().splitlines()[-1])
    assert d["keys_equal"] and d["changed"] > 0


def test_empty_processed_dataset_fails_before_launch(xtuner_env, base_model, tmp_path):
    shards = write_shards(tmp_path / "shards", alpaca_rows(8, nooutput=True))
    spec = make_spec(tmp_path, base_model, shards)
    with pytest.raises(XTunerConfigError, match="processed dataset is empty"):
        run_xtuner(spec, shards, tmp_path / "run", log=QUIET, env=xtuner_env)
    logs = tmp_path / "run" / "xtuner" / "logs"
    assert (logs / "prepare.log").is_file() and not (logs / "train.log").exists()
