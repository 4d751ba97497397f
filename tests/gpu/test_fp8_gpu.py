"""train.precision fp8 (torchao float8 linears) and train.compile on CUDA: the same trainer, NCCL.

Skipped without CUDA (and without torchao: `pip install .[fp8]`). fp8 is compared with bf16 loosely (float8
rounding of every block matmul): the curve falls and stays within FP8_TOL of bf16's over 8 steps."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tests.support.harness import launch, make_job, write_corpus

pytestmark = pytest.mark.gpu  # tests/conftest.py skips every gpu-marked test without CUDA
FP8_TOL = 0.1
BF16_TOL = 2e-2
STEPS = 8
ONE = {"micro_batch": 2, "grad_accum": 4}


def _run(root, corpus, name, nproc=1, **train):
    kw = {"precision": "bf16", **train}
    plan = ONE if nproc == 1 else {"dp_shard": nproc, "micro_batch": 2, "grad_accum": 4 // nproc}
    job = make_job(root / name, corpus, model="small", steps=STEPS, seq_len=128, train_kw=kw, **plan)
    return launch(nproc, job, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("torchao")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need compute capability 8.9+ (Ada, Hopper)")
    root = tmp_path_factory.mktemp("fp8")
    corpus = write_corpus(root / "corpus")
    out = {
        "bf16": _run(root, corpus, "bf16"),
        "tensorwise": _run(root, corpus, "tensorwise", precision="fp8"),
        "rowwise": _run(root, corpus, "rowwise", precision="fp8", fp8_recipe="rowwise"),
        "bf16_compiled": _run(root, corpus, "bf16_compiled", compile=True),
        "fp8_compiled": _run(root, corpus, "fp8_compiled", precision="fp8", compile=True),
    }
    if torch.cuda.device_count() >= 2:
        out["fsdp2_tensorwise"] = _run(root, corpus, "fsdp2_tensorwise", nproc=2, precision="fp8")
    return out


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "fp8_compiled", "fsdp2_tensorwise"])
def test_fp8_follows_bf16(runs, name):
    if name not in runs:
        pytest.skip("needs 2 GPUs")
    ref, got = runs["bf16"].losses, runs[name].losses
    assert len(got) == STEPS and all(math.isfinite(x) for x in got), runs[name].output[-3000:]
    assert got[-1] < got[0]
    assert max(abs(a - b) for a, b in zip(ref, got)) < FP8_TOL, (ref, got)


@pytest.mark.timeout(1800)
def test_bf16_compile_follows_eager(runs):
    ref, got = runs["bf16"].losses, runs["bf16_compiled"].losses
    assert max(abs(a - b) for a, b in zip(ref, got)) < BF16_TOL, (ref, got)
