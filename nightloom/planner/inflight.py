"""How many layers' activations each pipeline rank holds at its peak, under the schedule the trainer runs.

Without a pipeline, gradient accumulation holds one micro-batch at a time. GPipe runs every micro-batch forward first: a rank holds all m of them. 1F1B (Narayanan et al. 2021 §2.2) lets rank
r run pp − r forwards before its first backward, then alternates: min(pp − r, m) micro-batches of its layers.
Interleaved 1F1B (§2.2.2) is simulated op by op in torch.distributed.pipelining's order (ScheduleInterleaved1F1B,
the trainer's): micro-batches go through a rank's chunks in rounds of m / max(1, m // pp), rank r runs
(v − 1)·round + 2·(pp − 1 − r) forwards first (at most v·m), then one forward and one backward per op, backwards
from the last chunk back. Chunks differ in size (Llama 3's lighter end chunks, an embedding-only first chunk), so
the peak counts layers, not micro-batches: Narayanan's average factor 1 + (pp − 1)/(pp·v) over- or under-counts a
rank whose chunks are uneven.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4096)
def in_flight_layers(chunks: tuple[int, ...], pp: int, microbatches: int, schedule: str) -> tuple[int, ...]:
    """Peak (layers × micro-batches) of saved activations on every pipeline rank; `chunks` are the layers of the
    pp·v pipeline chunks in model order (chunk j on rank j mod pp; zbv: ParallelDims.chunk_rank's V)."""
    v = len(chunks) // pp
    m = microbatches
    if schedule == "zbv":
        return tuple(_peak((chunks[r], chunks[2 * pp - 1 - r]), _zbv_events(r, pp, m)) for r in range(pp))
    per_rank = [sum(chunks[r::pp]) for r in range(pp)]
    if pp == 1:  # gradient accumulation: each micro-batch's backward runs before the next forward
        return (per_rank[0] * min(1, m),)
    if schedule == "gpipe":
        return tuple(n * m for n in per_rank)
    if v == 1:
        return tuple(n * min(pp - r, m) for r, n in enumerate(per_rank))
    return tuple(_peak(chunks[r::pp], _interleaved_events(v, r, pp, m)) for r in range(pp))


def _peak(local: tuple[int, ...], events: tuple[tuple[int, bool], ...]) -> int:
    """The most a rank holds over its `events` (local chunk, True: a forward keeps that chunk's activations, False:
    a pass frees them); `local[k]`: the size of its k-th chunk."""
    held = peak = 0
    for chunk, keeps in events:
        if keeps:
            held += local[chunk]
            if held > peak:
                peak = held
        else:
            held -= local[chunk]
    return peak


@lru_cache(maxsize=256)  # an entry is 2·m·v events or fewer: a bounded cache keeps a search within ~100 MB
def _interleaved_events(v: int, rank: int, pp: int, m: int) -> tuple[tuple[int, bool], ...]:
    """One rank's interleaved 1F1B ops as `_peak`'s events. Cached: the chunk sizes vary with every candidate of a
    search, the order only with v, pp, m and the rank."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = m * v
    events = []
    for op in range(total + warmup):
        if op < total:  # a forward (warm-up, then one per 1F1B op)
            events.append(((op // per_round) % v, True))
        if op >= warmup:  # a backward, the last chunk first
            events.append((v - 1 - ((op - warmup) // per_round) % v, False))
    return tuple(events)


def zbv_ops(rank: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    """One rank's ops under the V-shaped zero-bubble schedule (Qi et al. 2024 §6, in torch's ScheduleZBVZeroBubble
    order): (kind F / I / W, local chunk 0 or 1, micro-batch). Warm-up: 2(pp − r) − 1 forwards of chunk 0, then r
    pairs F1 F0, then pp − r triples F1 I1 W1; steady: F0 I0 W0 F1 I1 W1; cool-down: r pairs I0 I1, pp − r pairs
    I0 W0, the weight passes left. Micro-batches past m are padding (dropped)."""
    n = max(2 * pp - 1, m)
    ops: list[tuple[str, int, int]] = []
    done = {"F": [0, 0], "I": [0, 0], "W": [0, 0]}  # ops of each kind so far, per local chunk

    def run(times: int, *steps: str) -> None:
        for _ in range(times):
            for kind, chunk in ((step[0], int(step[1])) for step in steps):
                ops.append((kind, chunk, done[kind][chunk]))
                done[kind][chunk] += 1

    f, b, w = done["F"], done["I"], done["W"]
    run(2 * (pp - rank) - 1, "F0")
    run(rank, "F1", "F0")
    run(pp - rank, "F1", "I1", "W1")
    while f[1] < f[0] or f[0] < n:
        run(int(f[0] < n), "F0")  # the last forwards of chunk 0 are done before chunk 1
        run(1, "I0", "W0", "F1", "I1", "W1")
    run(rank, "I0", "I1")
    run(pp - rank, "I0", "W0")
    run(b[1] - w[1], "W1")
    run(b[0] - w[0], "W0")
    return [o for o in ops if o[2] < m]


@lru_cache(maxsize=256)
def _zbv_events(rank: int, pp: int, m: int) -> tuple[tuple[int, bool], ...]:
    """One rank's zbv ops as `_peak`'s events: a forward keeps its chunk's activations until the weight pass
    (torch's input pass keeps the graph for it: stage_backward_input retains it). Cached as _interleaved_events."""
    return tuple((chunk, kind == "F") for kind, chunk, _ in zbv_ops(rank, pp, m) if kind != "I")
