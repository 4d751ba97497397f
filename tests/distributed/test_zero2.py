"""ZeRO-2-like data parallel (FSDP2 reshard_after_forward=False): loss parity with one process, and the
parameters stay gathered between forward and backward while FSDP (ZeRO-3) reshards them."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import STEPS
from tests.distributed.harness import launch, make_job

TOL = 1e-5


@pytest.mark.timeout(300)
def test_zero2_matches_single_process(corpus, reference, tmp_path):
    job = make_job(tmp_path / "zero2", corpus, steps=STEPS, dp_shard=2, zero="zero2", micro_batch=2, grad_accum=2)
    out = launch(2, job, timeout=280)
    assert len(out.losses) == STEPS, out.output[-3000:]
    diff = max(abs(a - b) for a, b in zip(out.losses, reference.losses))
    print(f"zero2: max |loss - ref| = {diff:.2e}")
    assert diff <= TOL, (out.losses, reference.losses)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero,gathered", [("zero2", True), ("fsdp", False)])
def test_zero2_keeps_parameters_gathered_after_forward(zero, gathered, tmp_path):
    """One gloo process (a 1-rank mesh is enough to see FSDP2's reshard policy): after a forward, ZeRO-2's
    blocks hold unsharded parameters, ZeRO-3's do not."""
    import torch
    import torch.distributed as dist

    from nightloom.catalog import get_model
    from nightloom.train.model import build_model
    from nightloom.train.parallelize import _apply_fsdp

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'pg'}")
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        m = build_model(get_model("tiny"), 32, device="cpu")
        _apply_fsdp(m, mesh, None, keep_gathered=zero == "zero2")
        m(torch.zeros(1, 32, dtype=torch.long))
        block = next(iter(m.layers.values()))
        states = {type(p).__name__ for p in block.parameters()}
        assert (states == {"Parameter"}) is gathered, states
    finally:
        dist.destroy_process_group()
