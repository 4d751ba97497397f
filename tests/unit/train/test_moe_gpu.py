"""The experts' grouped-GEMM path (torch._grouped_mm, bf16 on a CUDA GPU) against the CPU loop's math on the same
rows and weights, uneven groups and an empty expert included. Skipped without CUDA (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from nightloom.train.moe import GroupedExperts, _grouped_mm_available

pytestmark = pytest.mark.gpu  # tests/conftest.py skips every gpu-marked test without CUDA


def test_grouped_mm_equals_the_loop():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 64, 96).cuda()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.05)
    counts = [37, 0, 5, 90]
    x = torch.randn(sum(counts), 64, device="cuda", dtype=torch.bfloat16)
    assert _grouped_mm_available(x)
    grouped = experts(x, counts)
    loop = experts(x.float(), counts)  # fp32: the loop
    err = float((grouped.float() - loop).abs().max() / loop.abs().max())
    print(f"grouped_mm vs loop: max relative error {err:.2e}")
    assert grouped.shape == loop.shape and err < 2e-2
    grouped.float().sum().backward()
    assert experts.w1.grad is not None and float(experts.w1.grad[1].abs().max()) == 0.0  # the empty expert
