"""What an XTuner run leaves, as a native run does: the model in `export/` and a LoRA adapter in `export/adapter/`,
named by the result record the summary reads; mmengine's start-up listing kept in the log file, not the live log;
the MFU peak measured as the native trainer measures it; the ranks' CPU peak memory in the step metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from nightloom.finetune.convert import convert_checkpoint
from nightloom.finetune.xtuner_plan import XTunerPlan


def fake_runner(cmd, log_file, log, step) -> int:
    """Stands in for the XTuner env: writes what pth_to_hf and merge write (node_wrapper.py MODE ARGS...)."""
    mode, args = cmd.argv[2], cmd.argv[3:]
    out = Path(args[2])  # pth_to_hf CONFIG PTH OUT; merge BASE ADAPTER OUT
    out.mkdir(parents=True)
    if mode == "pth_to_hf" and out.name.startswith("adapter"):
        (out / "adapter_config.json").write_text("{}")
        (out / "adapter_model.safetensors").write_bytes(b"a")
    else:
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"m")
    return 0


def plan(tmp_path: Path, method: str, merge: bool = True) -> XTunerPlan:
    return XTunerPlan(
        python="python",
        env_key="k",
        profile="cpu",
        method=method,
        merge_lora=merge,
        base_model=str(tmp_path / "base"),
        run_dir=str(tmp_path / "run"),
        config_path=str(tmp_path / "cfg.py"),
        work_dir=str(tmp_path / "run" / "work"),
        processed_dir=str(tmp_path / "p"),
        log_dir=str(tmp_path / "run" / "logs"),
        world_size=1,
        total_steps=2,
        tokens_per_step=8,
        data_files=[],
        prepare_key="x",
    )


@pytest.mark.parametrize("method, merge", [("lora", True), ("lora", False), ("full", True)])
def test_xtuner_writes_the_native_export_layout(tmp_path, method, merge):
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "stale.txt").write_text("an older export")  # replaced whole, never mixed
    out = convert_checkpoint(
        plan(tmp_path, method, merge), tmp_path / "iter_2.pth", log=lambda s: None, runner=fake_runner
    )
    export = run / "export"
    lora = method == "lora"
    assert out["model_dir"] == (str(export) if merge or not lora else None)
    assert out["adapter_dir"] == (str(export / "adapter") if lora else None)
    assert (export / "config.json").is_file() == (merge or not lora)
    assert (export / "adapter" / "adapter_config.json").is_file() == lora
    assert not (export / "stale.txt").exists()
    assert [p.name for p in run.iterdir()] == ["export"]  # no model/, adapter/ or staging folder left


def test_xtuner_export_files_get_the_umask_mode_not_0600(tmp_path):
    """safetensors' writer makes 0600 files: XTuner's export was unreadable by a teammate sharing the run folder
    (model.safetensors 0600 beside 0644 configs) while the native export's files get the umask's mode."""
    import os

    def private_runner(cmd, log_file, log, step) -> int:
        fake_runner(cmd, log_file, log, step)
        for f in Path(cmd.argv[3:][2]).iterdir():
            f.chmod(0o600)
        return 0

    mask = os.umask(0o027)
    try:
        convert_checkpoint(plan(tmp_path, "lora"), tmp_path / "iter_2.pth", log=lambda s: None, runner=private_runner)
    finally:
        os.umask(mask)
    export = tmp_path / "run" / "export"
    modes = {p.relative_to(export).as_posix(): p.stat().st_mode & 0o777 for p in export.rglob("*")}
    assert modes["model.safetensors"] == 0o640 and modes["adapter/adapter_model.safetensors"] == 0o640
    assert modes["adapter"] == 0o750


# mmengine's start-up output as the train step streams it (node prefix and all), shortened
STARTUP = """nightloom: CUDA absent: CPU adaptations applied
12/05 12:26:57 - mmengine - INFO -
------------------------------------------------------------
System environment:
    sys.platform: linux
    PyTorch compiling details: PyTorch built with:
  - GCC 13.3

    MMEngine: 0.10.6

Runtime environment:
    dist_cfg: {'backend': 'gloo', 'timeout': 120}
------------------------------------------------------------

12/05 12:26:57 - mmengine - INFO - Config:
batch_size = 2
default_hooks = dict(
    checkpoint=dict(
        by_epoch=False,
        type='mmengine.hooks.CheckpointHook'))
work_dir = '/r/xtuner/work_dir'

12/05 12:26:57 - mmengine - WARNING - Failed to search registry with scope "mmengine"
12/05 12:26:58 - mmengine - INFO - Hooks will be executed in the following order:
before_run:
(VERY_HIGH   ) RuntimeInfoHook
 --------------------
after_run:
(BELOW_NORMAL) LoggerHook
 --------------------
12/05 12:26:58 - mmengine - INFO - xtuner_dataset_timeout = 1:00:00
12/05 12:26:58 - mmengine - INFO - Iter(train) [ 1/20]  lr: 2.0000e-06  time: 0.0429  loss: 5.7164  memory: 620.7
Traceback (most recent call last):
  File "train.py", line 1"""


def test_mmengine_startup_listing_stays_in_the_log_file():
    from nightloom.finetune.logs import StartupDump

    dump = StartupDump("run/xtuner/logs/train.log")
    shown = [out for line in STARTUP.splitlines() for out in dump(f"[train] [local-0] {line}")]
    note = "[train] [local-0] ({} lines of mmengine's start-up listing (environment, config, hooks): run/xtuner/logs/train.log)"
    assert [s.removeprefix("[train] [local-0] ") for s in shown] == [
        "nightloom: CUDA absent: CPU adaptations applied",
        note.format(21).removeprefix("[train] [local-0] "),
        '12/05 12:26:57 - mmengine - WARNING - Failed to search registry with scope "mmengine"',
        note.format(7).removeprefix("[train] [local-0] "),
        "12/05 12:26:58 - mmengine - INFO - xtuner_dataset_timeout = 1:00:00",
        "12/05 12:26:58 - mmengine - INFO - Iter(train) [ 1/20]  lr: 2.0000e-06  time: 0.0429  loss: 5.7164  memory: 620.7",
        "Traceback (most recent call last):",  # a crash is never hidden
        '  File "train.py", line 1',
    ]
    assert dump.flush() == []


def test_xtuner_cpu_peak_is_the_native_trainers_measurement(monkeypatch):
    """One function, one size, one thread: the XTuner plan's CPU peak names the native trainer's source."""
    import torch

    from nightloom import perf
    from nightloom.finetune.xtuner_plan import _peak
    from nightloom.spec.load import load_spec

    threads, real_mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: (threads.append(torch.get_num_threads()), real_mm(a, b))[1])
    before = torch.get_num_threads()
    spec = load_spec(Path(__file__).resolve().parents[3] / "deployments" / "xtuner-lora-demo.yaml")
    flops, source = _peak(spec, "cpu", None)
    assert source == perf.cpu_matmul_peak_source() == "measured: torch.mm 1024x1024 fp32, best of 5, 1 thread"
    assert flops > 0 and set(threads) == {1} and len(threads) == 1 + perf.CPU_PEAK_REPEATS
    assert torch.get_num_threads() == before  # the caller's thread count is restored
