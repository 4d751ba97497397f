"""Sequence parallel that saves the sequence shard, not the all-gathered input, for the linears' weight gradients.

Under torch's TP with SequenceParallel norms, PrepareModuleInput all-gathers the norm's output (Shard(1) ->
Replicate) before the attention's and the MLP's column-parallel linears, and those linears save the gathered
[b, s, h] tensor for backward: t times the shard on every TP rank. Megatron-LM's column-parallel linear
(core/tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel) saves the
local shard and all-gathers it again in backward (Korthikanti et al. 2022 §4.2.2). `save_shard` does the same around
a module: while it runs forward, a saved-tensors hook saves any tensor backed by the gathered input's storage as the
shard, and its first unpack in backward gathers it again (once per module call, shared by q, k, v or w1, w3; freed
after their backward). The same ops run on the same values, so losses and gradients are unchanged; the cost is one
more all-gather per module in backward. Other saved tensors pass to the hooks outside (the ActivationMeter's, a
checkpoint's) unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class _Gather:
    """One module call's gathered input: its shard, and the gathered tensor while backward needs it."""

    __slots__ = ("full", "shard")

    def __init__(self, shard: torch.Tensor):
        self.shard, self.full = shard, None

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            from torch.distributed.tensor import Replicate

            self.full = _local(shard.redistribute(placements=[Replicate()] * len(shard.placements)))
        return self.full


class _Saved:
    """A saved view of the gathered input, kept as its shard (outer hooks' packing of it) and how to view it."""

    __slots__ = ("gather", "packed", "spec", "view")

    def __init__(self, t: torch.Tensor, gather: _Gather, packed):
        local = _local(t)
        self.view = (local.size(), local.stride(), local.storage_offset())
        self.spec = getattr(t, "_spec", None)  # a DTensor's mesh, placements, global shape
        self.gather, self.packed = gather, packed


class _ShardHooks:
    """The saved-tensors hooks of one module call whose gathered input has storage pointer `ptr`."""

    def __init__(self, shard: torch.Tensor, full: torch.Tensor):
        self.ptr = _local(full).untyped_storage().data_ptr()
        self.gather = _Gather(shard)
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) or None

    def pack(self, t: torch.Tensor):
        local = _local(t)
        try:
            mine = local.untyped_storage().data_ptr() == self.ptr
        except (RuntimeError, NotImplementedError):
            mine = False
        if not mine:
            return self.outer[0](t) if self.outer else t
        shard = self.gather.shard
        return _Saved(t, self.gather, self.outer[0](shard) if self.outer else shard)

    def unpack(self, x):
        if not isinstance(x, _Saved):
            return self.outer[1](x) if self.outer else x
        shard = self.outer[1](x.packed) if self.outer else x.packed
        size, stride, offset = x.view
        local = x.gather.gathered(shard).as_strided(size, stride, offset)
        if x.spec is None:
            return local
        from torch.distributed.tensor import DTensor

        s = x.spec
        return DTensor.from_local(local, s.mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride)


def save_shard(module: nn.Module) -> None:
    """Make `module` (its first input a sequence-sharded DTensor that its PrepareModuleInput gathers) save the shard
    for backward instead of the gathered input. Call after parallelize_module: the shard is taken by a pre-hook run
    before TP's."""

    def take_shard(mod, args):
        mod._sp_shard = args[0]

    module.register_forward_pre_hook(take_shard, prepend=True)
    forward = module.forward

    def run(x, *args, **kwargs):
        shard = module.__dict__.pop("_sp_shard", None)
        if shard is None or not torch.is_grad_enabled() or not hasattr(shard, "placements"):
            return forward(x, *args, **kwargs)
        hooks = _ShardHooks(shard, x)
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            return forward(x, *args, **kwargs)

    module.forward = run
