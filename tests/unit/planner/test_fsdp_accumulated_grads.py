"""FSDP2's accumulated gradients, which planner/memory.py prices (ACCUM_GRAD_BYTES): between micro-batches with the
reduce-scatter skipped, as the trainer and torch.distributed.pipelining run it, every unsharded gradient is kept
whole in the reduce dtype (fp32) until the last micro-batch reduces it."""

from __future__ import annotations

import torch

from nightloom.planner.memory import ACCUM_GRAD_BYTES


def _accumulated(model) -> list[torch.Tensor]:
    out = []
    for mod in model.modules():
        group = mod._get_fsdp_state()._fsdp_param_group if hasattr(mod, "_get_fsdp_state") else None
        out += [p.unsharded_accumulated_grad for p in (group.fsdp_params if group else [])]
    return out


def test_fsdp2_keeps_whole_fp32_gradients_until_the_last_micro_batch(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    n = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # the trainer's policy
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for i in range(3):
        model.set_requires_gradient_sync(i == 2)
        model(torch.randn(4, 32)).sum().backward()
        held = [g for g in _accumulated(model) if g is not None]
        if i < 2:  # every parameter's whole gradient, upcast to fp32
            assert sum(g.numel() * g.element_size() for g in held) == n * ACCUM_GRAD_BYTES
            assert {g.dtype for g in held} == {torch.float32}
        else:  # the last micro-batch reduce-scatters and frees them
            assert held == []


def _sharded_model(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def test_reducing_each_micro_batch_holds_nothing_and_sums_the_same(one_rank):
    """parallel.reduce_each_micro_batch (the trainer's set_requires_gradient_sync(True) every micro-batch): no
    unsharded gradient is held after any micro-batch, and the sharded gradients are the same sum."""
    xs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    grads = []
    for each in (False, True):
        model = _sharded_model(0)
        for i, x in enumerate(xs):
            model.set_requires_gradient_sync(each or i == 2)
            model(x).sum().backward()
            held = [g for g in _accumulated(model) if g is not None]
            assert (held == []) == (each or i == 2)
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
