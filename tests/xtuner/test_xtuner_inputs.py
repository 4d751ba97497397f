"""XTuner backend: input checks, config rendering and log parsing (no XTuner env needed; fast)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from nightloom.finetune import config as xcfg
from nightloom.finetune import env as xenv
from nightloom.finetune import run as xrun
from nightloom.finetune import xtuner_plan as xplan
from nightloom.finetune.logs import RunShape, XTunerLogError, collect_steps, write_metrics
from nightloom.spec import RunSpec
from tests.support.xtuner_data import alpaca_rows, make_spec, write_shards


@pytest.fixture
def no_env(monkeypatch):
    """Input errors must surface before the (slow) env is even looked at."""

    def boom(*a, **k):
        raise AssertionError("ensure_env called before the input checks failed")

    monkeypatch.setattr(xplan, "ensure_env", boom)


@pytest.fixture
def fake_base(tmp_path) -> Path:
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x")
    return d


@pytest.fixture
def shards(tmp_path) -> Path:
    return write_shards(tmp_path / "shards", alpaca_rows(8))


def test_unknown_map_function_fails_before_launch(tmp_path, fake_base, shards, no_env):
    spec = make_spec(tmp_path, fake_base, shards, map_fn="alpacca")
    with pytest.raises(xcfg.XTunerConfigError, match=r"train\.xtuner\.map_fn: unknown map function 'alpacca'.*alpaca"):
        xrun.run_xtuner(spec, shards, tmp_path / "run")
    assert not (tmp_path / "run" / "xtuner").exists()


def test_map_fn_accepts_full_name():
    assert xcfg.resolve_map_fn("openai_map_fn").name == "openai_map_fn"


def test_missing_base_model_files_named(tmp_path, shards, no_env):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    spec = make_spec(tmp_path, base, shards)
    with pytest.raises(xcfg.XTunerConfigError) as e:
        xrun.run_xtuner(spec, shards, tmp_path / "run")
    msg = str(e.value)
    assert "train.xtuner.base_model" in msg and str(base) in msg and "tokenizer" in msg and "weights" in msg
    assert "config.json" not in msg.split("missing")[1]


def test_base_model_not_a_folder(tmp_path, shards, no_env):
    spec = make_spec(tmp_path, tmp_path / "nope", shards)
    with pytest.raises(xcfg.XTunerConfigError, match="train.xtuner.base_model: not a folder"):
        xrun.run_xtuner(spec, shards, tmp_path / "run")


def test_shard_lacking_map_fn_columns(tmp_path, fake_base, no_env):
    shards = write_shards(tmp_path / "shards", [{"text": f"doc {i}"} for i in range(4)])
    spec = make_spec(tmp_path, fake_base, shards, map_fn="alpaca")
    with pytest.raises(
        xcfg.XTunerConfigError,
        match=r"alpaca_map_fn reads column\(s\) \['instruction', 'input', 'output'\].*shard-00000\.parquet",
    ):
        xrun.run_xtuner(spec, shards, tmp_path / "run")


def test_unknown_template(tmp_path, fake_base, shards, no_env):
    spec = make_spec(tmp_path, fake_base, shards, template="llama9_chat")
    with pytest.raises(xcfg.XTunerConfigError, match="train.xtuner.template: unknown prompt template 'llama9_chat'"):
        xrun.run_xtuner(spec, shards, tmp_path / "run")


def test_global_batch_must_divide_world(tmp_path, fake_base, shards):
    """At spec load, before anything is rented: the batch a rank takes, and the micro-batches it is cut into."""
    with pytest.raises(ValidationError, match="train.global_batch: 3 is not divisible by the world size 2"):
        make_spec(tmp_path, fake_base, shards, ranks=2, global_batch=3)
    with pytest.raises(ValidationError, match=r"train.xtuner.micro_batch: 3 does not divide the 4 sequences"):
        make_spec(tmp_path, fake_base, shards, ranks=2, global_batch=8, micro_batch=3)
    spec = make_spec(tmp_path, fake_base, shards, ranks=2, global_batch=8, micro_batch=2)
    data = spec.model_dump(mode="json", by_alias=True)
    data["train"]["xtuner"]["zero_stage"] = 2
    with pytest.raises(ValidationError, match="2 micro-batches per step with zero_stage 2"):
        RunSpec.model_validate(data)
    assert xcfg.micro_batches(8, 2, 2) == 2 and xcfg.micro_batches(8, 2, None) == 1 and xcfg.micro_batches(8, 1, 2) == 4


def test_micro_batches_rendered_and_kept_for_fewer_ranks(tmp_path, fake_base, shards, monkeypatch):
    """The config cuts each rank's batch into micro-batches; recovery's replan (the first plan's micro_batch on
    fewer ranks) keeps the forward and accumulates more of them."""
    from nightloom.finetune.env import XTunerEnv

    env = XTunerEnv(
        key="k", created=False, seconds=0.0, path=tmp_path, python=Path(sys.executable), profile="cpu", versions={}
    )
    monkeypatch.setattr(xplan, "_hf_flops_per_token", lambda *a, **k: None)
    spec = make_spec(tmp_path, fake_base, shards, ranks=4, global_batch=8)
    first = xplan.plan_xtuner(spec, shards, tmp_path / "run", env=env, peak_flops=1.0)
    assert (first.world_size, first.micro_batch, first.micro_batches) == (4, 2, 1)
    fewer = xplan.plan_xtuner(spec, shards, tmp_path / "run", env=env, peak_flops=1.0, world_size=1, micro_batch=2)
    assert (fewer.world_size, fewer.micro_batch, fewer.micro_batches) == (1, 2, 4)
    text = Path(fewer.config_path).read_text()
    assert "batch_size = 8 " in text and "micro_batches = 4 " in text
    assert 'type="nightloom_micro.MicroBatchDDP", micro_batches=micro_batches' in text
    assert fewer.tokens_per_step == first.tokens_per_step and fewer.total_steps == first.total_steps
    with pytest.raises(xcfg.XTunerConfigError, match="train.xtuner.micro_batch: 2 does not divide the 1 sequences"):
        xplan.plan_xtuner(spec, shards, tmp_path / "run", env=env, peak_flops=1.0, world_size=8, micro_batch=2)
    # recovery's replan: 4 -> 2 ranks accumulate 2 forwards each; 4 -> 3 cannot (8 sequences on 3 ranks) and
    # is refused by the world check, 3 -> 2 with 6 sequences falls back to 3 per rank at once, said in the log
    assert xplan.plan_for_world(spec, shards, first, 2, env=env).micro_batches == 2
    odd = make_spec(tmp_path, fake_base, shards, ranks=3, global_batch=6, micro_batch=2)
    first3 = xplan.plan_xtuner(odd, shards, tmp_path / "run", env=env, peak_flops=1.0)
    said: list[str] = []
    two = xplan.plan_for_world(odd, shards, first3, 2, env=env, log=said.append)
    assert (two.micro_batches, two.micro_batch) == (1, 3) and "take global_batch / world size" in said[0], said


def test_missing_manifest(tmp_path, fake_base):
    spec = make_spec(tmp_path, fake_base, tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no shard manifest"):
        xrun.run_xtuner(spec, tmp_path / "empty", tmp_path / "run")


@pytest.mark.parametrize(
    "method,sp,zero,field",
    [("qlora", 1, 0, "method"), ("lora", 2, 0, "sequence_parallel_size"), ("full", 1, 2, "zero_stage")],
)
def test_cpu_profile_refuses_gpu_only_features(method, sp, zero, field):
    with pytest.raises(xcfg.XTunerConfigError, match=f"train.xtuner.{field}"):
        xcfg.check_profile("cpu", method, zero, sp)
    xcfg.check_profile("gpu", method, zero, sp)  # allowed there


def _inputs(tmp_path, profile="cpu", method="lora", **kw) -> xcfg.RenderInputs:
    base = dict(
        profile=profile,
        method=method,
        base_model="/m",
        data_files=["/d/a.parquet"],
        data_format="parquet",
        map_fn=xcfg.MAP_FNS["alpaca"],
        template="default",
        work_dir=str(tmp_path / "w"),
        processed_dir=str(tmp_path / "p"),
        hf_cache_dir=str(tmp_path / "c"),
        max_length=64,
        batch_size=2,
        max_iters=5,
        warmup_iters=1,
        lr=1e-3,
        min_lr_ratio=0.1,
        weight_decay=0.0,
        max_norm=1.0,
        save_steps=5,
        seed=1,
        dist_timeout_s=60,
    )
    base.update(kw)
    return xcfg.RenderInputs(**base)


@pytest.mark.parametrize("profile,method", [("cpu", "full"), ("cpu", "lora"), ("gpu", "qlora"), ("gpu", "lora")])
def test_rendered_configs_are_python_with_the_values(tmp_path, profile, method):
    out = xcfg.render_config(_inputs(tmp_path, profile, method, data_files=["/d/it's.parquet"]), tmp_path / "c.py")
    text = out.read_text()
    assert "{{" not in text
    ns: dict = {}
    # execute only the plain-value settings block (the rest needs xtuner's lazy imports)
    block = text.split("# --- settings (rendered) ---")[1].split("# --- model ---")[0]
    exec(block, ns)
    assert ns["data_files"] == ["/d/it's.parquet"] and ns["method"] == method and ns["profile"] == profile
    assert "from xtuner.dataset.map_fns import alpaca_map_fn," in text
    assert ('backend="gloo"' in text) == (profile == "cpu")
    assert ("AmpOptimWrapper" in text) == (profile == "gpu")


def test_render_template_rejects_mismatched_placeholders():
    with pytest.raises(xcfg.XTunerConfigError, match=r"without a value: \['b'\]"):
        xcfg.render_template("a = {{a}}\nb = {{b}}", {"a": 1})
    with pytest.raises(xcfg.XTunerConfigError, match=r"without a placeholder: \['z'\]"):
        xcfg.render_template("a = {{a}}", {"a": 1, "z": 2})
    with pytest.raises(xcfg.XTunerConfigError, match="not a Python identifier"):
        xcfg.Ident("os.system('x')")
    assert xcfg.render_template("x = {{a}}; f = {{f}}", {"a": "q'\"", "f": xcfg.Ident("g")}) == "x = 'q\\'\"'; f = g"


def test_processed_stats_empty_or_missing(tmp_path):
    with pytest.raises(xcfg.XTunerConfigError, match="missing or incomplete"):
        xcfg.read_processed_stats(tmp_path)
    (tmp_path / xcfg.STATS_FILE).write_text(json.dumps({"rows": 0, "tokens": 0}))
    with pytest.raises(xcfg.XTunerConfigError, match="processed dataset is empty"):
        xcfg.read_processed_stats(tmp_path)


def _launch(work: Path, stamp: str, rows: list[dict], tail: str = "") -> None:
    d = work / stamp / "vis_data"
    d.mkdir(parents=True)
    (d / "scalars.json").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_logs_merge_launches_and_mark_resume_gap(tmp_path):
    _launch(
        tmp_path,
        "20260101_000000",
        [{"step": s, "iter": s, "loss": 5.0 - s, "lr": 1e-3, "time": 0.5} for s in (1, 2, 3)],
        tail='{"step": 4, "lo',
    )
    _launch(
        tmp_path,
        "20260101_000100",
        [{"step": s, "iter": s, "loss": 9.0 - s, "time": 0.25, "grad_norm": 1.5} for s in (3, 4)],
    )
    steps = collect_steps(
        tmp_path, RunShape(tokens_per_step=100, flops_per_token=10.0, n_devices=2, peak_flops_per_device=1000.0)
    )
    assert [m.step for m in steps] == [1, 2, 3, 4]
    assert [m.loss for m in steps] == [4.0, 3.0, 6.0, 5.0]  # the later launch wins
    assert [m.gap for m in steps] == [False, False, True, False]
    assert steps[2].attempt == 1 and steps[0].attempt == 0
    assert steps[3].tokens_per_s == pytest.approx(400.0)
    assert steps[3].mfu == pytest.approx(400.0 * 10.0 / (2 * 1000.0))
    out = write_metrics(tmp_path, tmp_path / "metrics.jsonl", RunShape(100))
    from nightloom.metrics import read_metrics

    assert [m.loss for m in read_metrics(tmp_path / "metrics.jsonl")] == [m.loss for m in out]


def test_logs_corrupt_middle_line_named(tmp_path):
    _launch(
        tmp_path,
        "20260101_000000",
        [{"step": 1, "loss": 1.0}],
        tail="{bad\n" + json.dumps({"step": 2, "loss": 1.0}) + "\n",
    )
    with pytest.raises(XTunerLogError, match=r"scalars\.json:2: corrupt JSON"):
        collect_steps(tmp_path, RunShape(1))


def test_logs_text_fallback_and_empty(tmp_path):
    with pytest.raises(XTunerLogError, match="no training steps logged"):
        write_metrics(tmp_path, tmp_path / "m.jsonl", RunShape(1))
    d = tmp_path / "20260101_000000"
    d.mkdir()
    (d / "20260101_000000.log").write_text(
        "11/29 22:00:18 - mmengine - INFO - Iter(train) [ 1/4]  lr: 1.0000e-05  eta: 0:00:01  time: 0.0398  "
        "data_time: 0.0070  grad_norm: 0.4412  loss: 5.7450\nother line\n"
        "11/29 22:00:18 - mmengine - INFO - Iter(train) [ 2/4]  lr: 1.0000e-03  time: 0.0346  loss: 5.7321\n"
    )
    steps = collect_steps(tmp_path, RunShape(10))
    assert [(m.step, m.loss, m.lr) for m in steps] == [(1, 5.745, 1e-05), (2, 5.7321, 1e-3)]
    assert steps[0].grad_norm == pytest.approx(0.4412)


def test_env_key_follows_requirements(tmp_path, monkeypatch):
    req = tmp_path / "requirements.txt"
    req.write_text("xtuner==0.2.0\n")
    monkeypatch.setitem(xenv.PROFILES, "cpu", {**xenv.PROFILES["cpu"], "requirements": req})
    k1 = xenv.env_key("cpu")
    assert k1 == xenv.env_key("cpu")
    req.write_text("xtuner==0.2.1\n")
    assert xenv.env_key("cpu") != k1
    monkeypatch.delenv("NIGHTLOOM_XTUNER_ENV", raising=False)
    monkeypatch.setenv("NIGHTLOOM_ENV_ROOT", str(tmp_path))
    assert xenv.env_path("cpu") == tmp_path / f"xtuner-cpu-{xenv.env_key('cpu')}"
    monkeypatch.setenv("NIGHTLOOM_XTUNER_ENV", str(tmp_path / "mine"))
    assert xenv.env_path("cpu") == tmp_path / "mine"


def test_requirements_lock_pins_the_known_traps():
    pins = dict(
        line.split("==")
        for line in xenv.PROFILES["cpu"]["requirements"].read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert pins["xtuner"] == "0.2.0" and pins["transformers"] == "4.48.0" and pins["torch"] == "2.13.0"
    assert int(pins["datasets"].split(".")[0]) < 4  # LengthGroupedSampler breaks on datasets>=4
    assert "torchvision" not in pins  # the PyPI wheel is a CUDA build: breaks `import transformers` on CPU


def test_orchestrator_venv_has_no_xtuner():
    import importlib.util

    assert importlib.util.find_spec("xtuner") is None, "xtuner must live only in its node env"
