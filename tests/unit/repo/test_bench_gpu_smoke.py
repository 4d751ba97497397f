"""bench/gpu.py --smoke runs its training grid on a CPU (tiny model, fp32, train.compile off: the compiled
variant costs a first compile, tests/distributed/test_efficiency.py covers it) and prints torchtitan's figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_bench_gpu_smoke_runs_on_cpu():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--no-compile"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "fp32             tokens/s" in out and "MFU" in out
    assert "fp8              not run: train.precision fp8 needs a CUDA GPU" in out
    assert "FSDP + compile + Float8    TPS/GPU  8,532" in out  # torchtitan's published figure, cited
