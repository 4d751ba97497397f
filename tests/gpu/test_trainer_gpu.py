"""The trainer on CUDA: NCCL + bf16 (FSDP2 MixedPrecisionPolicy / autocast) and context parallel, same code path.

Skipped without CUDA. bf16 runs compare with a loose tolerance (bf16 rounding, ~1e-2)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tests.support.harness import launch, make_job, write_corpus

pytestmark = pytest.mark.gpu  # tests/conftest.py skips every gpu-marked test without CUDA
BF16_TOL = 2e-2


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def bf16_reference(corpus, tmp_path_factory):
    job = make_job(
        tmp_path_factory.mktemp("ref") / "run",
        corpus,
        steps=5,
        seq_len=64,
        train_kw={"precision": "bf16"},
        micro_batch=2,
        grad_accum=4,
    )
    out = launch(1, job, timeout=300)
    return out


@pytest.mark.timeout(400)
def test_single_gpu_bf16_trains(bf16_reference):
    losses = bf16_reference.losses
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert bf16_reference.metrics[-1].peak_mem_bytes > 0  # CUDA max_memory_allocated


@pytest.mark.timeout(400)
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    "name,plan",
    [
        ("fsdp2_bf16", {"dp_shard": 2, "micro_batch": 2, "grad_accum": 2}),
        ("cp2_bf16", {"cp": 2, "micro_batch": 2, "grad_accum": 4}),
        ("tp2_sp_bf16", {"tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 4}),
    ],
)
def test_two_gpu_layouts_match_one_gpu(name, plan, corpus, bf16_reference, tmp_path):
    job = make_job(tmp_path / name, corpus, steps=5, seq_len=64, train_kw={"precision": "bf16"}, **plan)
    out = launch(2, job, timeout=300)
    diff = max(abs(a - b) for a, b in zip(out.losses, bf16_reference.losses))
    print(f"{name}: max |loss - ref| = {diff:.2e}")
    assert len(out.losses) == 5 and diff <= BF16_TOL
