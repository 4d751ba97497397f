"""GPU-only XTuner paths: QLoRA, fp16/bf16 AMP, sequence parallel. Skipped without CUDA (never run in CPU CI).

They need the GPU env profile (nightloom/finetune/requirements-gpu.txt), built on the GPU machine itself.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nightloom.metrics import read_metrics
from tests.support.xtuner_data import alpaca_rows, make_spec, write_shards

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_env(xtuner_env):
    import subprocess

    from nightloom.finetune.env import EnvError, ensure_env, probe

    if not probe(xtuner_env.python)["cuda"]:
        try:
            env = ensure_env(profile="gpu")
        except (EnvError, OSError, subprocess.SubprocessError) as e:  # no driver / no GPU wheels here
            pytest.skip(f"no CUDA XTuner env: {e}")
        if not probe(env.python)["cuda"]:
            pytest.skip("CUDA not available in the XTuner env")
        return env
    return xtuner_env


def _run(gpu_env, base_model, tmp_path, ranks=1, **xt):
    from nightloom.finetune.run import run_xtuner

    shards = write_shards(tmp_path / "shards", alpaca_rows(48))
    spec = make_spec(
        tmp_path, base_model, shards, ranks=ranks, global_batch=2 * ranks, steps=4, method=xt.pop("method", "lora")
    )
    for k, v in xt.items():
        setattr(spec.train.xtuner, k, v)
    spec.cluster.gpu_type = "h100"
    return run_xtuner(spec, shards, tmp_path / "run", log=lambda s: None, env=gpu_env)


def test_qlora_one_gpu(gpu_env, base_model, tmp_path):
    r = _run(gpu_env, base_model, tmp_path, method="qlora")
    assert all(math.isfinite(m.loss) for m in read_metrics(r.metrics_path))
    assert (Path(r.adapter_dir) / "adapter_config.json").is_file() and r.model_dir


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_amp_lora(gpu_env, base_model, tmp_path, amp):
    r = _run(gpu_env, base_model, tmp_path, amp=amp)
    cfg = Path(r.config_path).read_text()
    assert f"amp_dtype = {'float16' if amp == 'fp16' else 'bfloat16'!r}" in cfg
    assert all(math.isfinite(m.loss) for m in read_metrics(r.metrics_path))


def test_sequence_parallel_two_gpus(gpu_env, base_model, tmp_path):
    import torch

    if torch.cuda.device_count() < 2:  # orchestrator view; the env shares the machine
        pytest.skip("sequence parallel needs 2 GPUs")
    r = _run(gpu_env, base_model, tmp_path, ranks=2, sequence_parallel_size=2)
    assert [m.step for m in read_metrics(r.metrics_path)] == [1, 2, 3, 4]


def test_micro_batches_on_one_gpu(gpu_env, base_model, tmp_path):
    """One GPU rank taking the global batch of 2 in 2 micro-batches (torchrun + NCCL, so mmengine wraps the model
    in nightloom_micro.MicroBatchDDP): AMP backward per chunk, one step, the loss all-reduced for the log."""
    r = _run(gpu_env, base_model, tmp_path, micro_batch=1)
    cfg = Path(r.config_path).read_text()
    assert "micro_batches = 2 " in cfg and "batch_size = 2 " in cfg
    log = (tmp_path / "run" / "xtuner" / "logs" / "train.log").read_text()
    assert "--nproc-per-node=1" in log  # under torchrun: mmengine wraps the model only when distributed
    steps = read_metrics(r.metrics_path)
    assert [m.step for m in steps] == [1, 2, 3, 4] and all(math.isfinite(m.loss) for m in steps)
