"""A pipeline stage whose receive buffers live only while their micro-batch is in flight.

torch.distributed.pipelining's PipelineStage (torch 2.13) allocates, at the first step, one activation receive
buffer and one gradient receive buffer per micro-batch for every chunk, and keeps all of them for the whole run:
a middle chunk holds 2·m boundary tensors of (micro_batch, seq (/tp under SP), hidden) whatever the schedule keeps
in flight (measured: tests/distributed/test_pipeline_memory.py; docs/efficiency.md). Megatron-LM allocates each
receive tensor when it communicates (p2p_communication.py) and keeps it only while the micro-batch needs it.
`LeanStage` does the same on torch's stage: a buffer is made just before its receive is posted and let go after
the micro-batch's backward, so a chunk holds the inputs of its micro-batches in flight (which its first block saves
anyway) and one gradient buffer while a backward waits for it.

A chunk that is not the model's last also keeps its output for backward (torch's fwd_cache), though backward needs
only the output's autograd node, not its values. Megatron-LM frees the output's data once sent
(schedules.deallocate_output_tensor); `LeanStage` does the same: the send gets its own alias of the output's storage
(torch sends a detached tensor), and the cached output's data becomes one element expanded to its shape (so
autograd's shape check still passes), so the storage lives only until the schedule has waited for the send.
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage


class LeanStage(PipelineStage):
    """PipelineStage with receive buffers made per micro-batch and dropped after its backward, sent outputs' data
    freed, and with `reduce_each_micro_batch` FSDP2's gradients reduce-scattered after every micro-batch."""

    def __init__(self, *args, reduce_each_micro_batch: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.reduce_each_micro_batch = reduce_each_micro_batch
        self._templates: dict[tuple[str, int], torch.Tensor] = {}  # (kind, input index) -> meta tensor

    def _fresh(self, kind: str, infos) -> None:
        """Give every received input of one micro-batch a new buffer shaped as the first one torch made."""
        for i, info in enumerate(infos):
            if info.is_root_arg:
                continue
            key = (kind, i)
            if key not in self._templates and info.buffer is not None:
                self._templates[key] = torch.empty_like(info.buffer, device="meta")
            template = self._templates.get(key)
            if template is not None:
                info.buffer = torch.empty_strided(
                    template.shape, template.stride(), dtype=template.dtype, device=self.device
                )

    @staticmethod
    def _drop(infos) -> None:
        for info in infos:
            if not info.is_root_arg:
                info.buffer = None

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._fresh("act", self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        ops = super().get_fwd_send_ops(fwd_chunk_id)
        sent = {id(op.tensor) for op in ops}
        for out in self.fwd_cache[fwd_chunk_id][0] if ops else ():
            # TP's all-reduced embedding output (an embedding-only chunk) wraps the tensor that holds the bytes
            held = out.elem if isinstance(out, AsyncCollectiveTensor) else out
            # a tensor whose storage the send holds through its own alias: its values are no longer needed
            if type(held) is torch.Tensor and out.grad_fn is not None and not sent & {id(out), id(held)}:
                held.data = torch.empty(1, dtype=held.dtype, device=held.device).expand(held.shape)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            self._fresh("grad", self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        """torch's helper turns FSDP2's gradient sync off for every micro-batch (the stage is reduced once, at the
        schedule's end, perform_reduce_grad); with `reduce_each_micro_batch` it stays on, so each micro-batch's
        gradients are reduce-scattered into the sharded ones as its backward ends (no unsharded fp32 gradients
        held between micro-batches); perform_reduce_grad then finds nothing left to reduce."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.pipelining._backward import stage_backward

        if not (self.reduce_each_micro_batch and backward_type == "full" and isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(False)
        self.submod.set_requires_gradient_sync(True)
        kw = bwd_kwargs
        return stage_backward(kw["stage_output"], kw["output_grads"], kw["input_values"]), None

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        # the gradient of the inputs is in bwd_cache (sent next); what backward still needs (zero-bubble's weight
        # pass) holds its own references: the buffers themselves are no longer needed
        self._drop(self.args_recv_info.get(bwd_chunk_id, ()))
        self._drop(self.grad_recv_info.get(bwd_chunk_id, ()))
