"""Activation offload in the plan (parallel.offload_layers; the trainer's half: train/offload.py): the device memory
it saves, the host memory and time it costs, and the fewest layers `parallel: auto` offloads where a layout fits no
other way.

Memory: an offloaded layer keeps nothing on the device between its forward and its backward but the chunk's input
(a received buffer the stage holds anyway, or the embedding's output: planner/stage_memory.py). On a GPU two layers'
tensors may be there beside the rest, one on its way out, one brought back for its backward (`working_bytes`).
Host: every offloaded layer of every micro-batch in flight (`host_bytes`, pinned).
Time: an offloaded layer's saved bytes cross the host link once each way per micro-batch (PCIe is full duplex: out
and back overlap), on a side stream beside the rank's compute, so a micro-batch's copies are exposed only where they
outlast its slot (`exposed_s`).
Host link per GPU (GPUSpec.host_bw): PCIe 4.0 x16 31.5 GB/s and 5.0 x16 63 GB/s a direction (PCI-SIG), at the 80%
that pinned copies reach.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from nightloom.parallel import ParallelDims
from nightloom.planner.grad_sync import gradient_sync
from nightloom.planner.inflight import in_flight_layers

#: Pinned host memory `parallel: auto` lets the offload take per GPU: a quarter of a DGX H100's 2 TB over its 8 GPUs
#: (the rest for the OS, data loading and checkpoint staging: page-locked memory is never swapped out). A pinned
#: parallel.offload_layers is taken as it is, its host memory shown in the plan.
HOST_GIB_PER_GPU = 64.0


def working_bytes(c: ParallelDims, layer_bytes: float) -> float:
    """What an offloading rank may hold beyond its resident activations on a GPU: the layer whose copy out has not
    run yet and the layer brought back ahead of its backward (stage_memory.py counts what the trainer measures)."""
    return 2 * layer_bytes if c.offload_layers else 0.0


def host_bytes(shape, c: ParallelDims, layer_bytes: float, input_bytes: float) -> tuple[float, ...]:
    """Pinned host memory per GPU of every pipeline rank at its peak: its offloaded layers of every micro-batch in
    flight, less each chunk's input (`input_bytes`), which stays on the device."""
    chunks = tuple(k * layer_bytes - (input_bytes if k else 0.0) for k in c.offloaded_per_chunk(shape.layers))
    return in_flight_layers(chunks, c.pp, c.grad_accum, c.schedule) if c.offload_layers else (0.0,) * c.pp


def exposed_s(c: ParallelDims, layers: int, layer_bytes: float, host_bw: float, slot_s: float) -> float:
    """Seconds a step waits on the copies: per micro-batch the busiest rank's offloaded bytes over the host link,
    beyond the slot they overlap."""
    if not c.offload_layers:
        return 0.0
    off = c.offloaded_per_chunk(layers)
    per_rank = [sum(off[j] for j in c.rank_chunks(r)) for r in range(c.pp)]
    return c.grad_accum * max(0.0, max(per_rank) * layer_bytes / host_bw - slot_s)


def fit_memory(
    c: ParallelDims, fixed, native_trainer: bool, usable_gib: float, memory_of: Callable, layers: int
) -> tuple[ParallelDims, object]:
    """(candidate, memory_of(candidate)) with the memory savers `fixed` pins or, where the candidate does not fit,
    `parallel: auto` takes: FSDP2 reducing every micro-batch (grad_sync.py), then the fewest offloaded layers that
    fit (nightloom's trainer, no recompute; all of the busiest rank's where none fits, the smallest memory)."""
    c, mem = gradient_sync(c, fixed.reduce_each_micro_batch, native_trainer, usable_gib, memory_of)
    if fixed.offload_layers is not None:
        if fixed.offload_layers == c.offload_layers:
            return c, mem
        c = replace(c, offload_layers=fixed.offload_layers)
        return c, memory_of(c)
    if not native_trainer or c.recompute != "none" or mem[0].total_gib <= usable_gib:
        return c, mem
    most = replace(c, offload_layers=max(c.rank_sizes(layers)))
    best = (most, memory_of(most))
    if best[1][0].total_gib > usable_gib:
        return best if best[1][0].host_gib <= HOST_GIB_PER_GPU else (c, mem)  # nothing fits: the smallest memory
    lo, hi = 1, most.offload_layers
    while lo < hi:  # the fewest that fit (device memory falls as more layers are offloaded); hi always fits
        n = (lo + hi) // 2
        cand = replace(c, offload_layers=n)
        cand_mem = memory_of(cand)
        if cand_mem[0].total_gib <= usable_gib:
            hi, best = n, (cand, cand_mem)
        else:
            lo = n + 1
    return best if best[1][0].host_gib <= HOST_GIB_PER_GPU else (c, mem)  # more host memory the fewer needs
