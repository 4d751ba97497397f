"""When FSDP2 reduce-scatters gradients: after the last micro-batch (its default under gradient accumulation, which
keeps every unsharded gradient in fp32 between micro-batches: memory.ACCUM_GRAD_BYTES) or after every micro-batch
(`reduce_each_micro_batch`: none kept, one reduce-scatter more per micro-batch, steptime.py). `parallel: auto`
takes the second only where the first does not fit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from nightloom.parallel import ParallelDims


def gradient_sync(
    c: ParallelDims, pinned: bool | None, native_trainer: bool, usable_gib: float, memory_of: Callable
) -> tuple[ParallelDims, object]:
    """(candidate, memory_of(candidate)): reduced each micro-batch where `pinned`, or where only that fits (pinned
    None, nightloom's trainer, FSDP with gradient accumulation); else after the last micro-batch."""
    if pinned:
        c = replace(c, reduce_each_micro_batch=True)
    mem = memory_of(c)
    helps = native_trainer and c.shard > 1 and c.grad_accum > 1 and not c.reduce_each_micro_batch
    if pinned is None and helps and mem[0].total_gib > usable_gib:
        c = replace(c, reduce_each_micro_batch=True)
        mem = memory_of(c)
    return c, mem
