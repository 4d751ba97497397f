"""A one-rank gloo process group for unit tests of collectives-backed code (FSDP2's DTensor shards, DCP's
save and load) inside the pytest process, without a launch."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_rank():
    """A one-rank gloo group over an in-memory store, torn down after the test (unless one already existed)."""
    import torch.distributed as dist

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owns:
        dist.destroy_process_group()
