"""Activation bytes each pipeline rank holds at its peak under nightloom's trainer: its chunks' layers for every
micro-batch in flight plus what the stage boundary keeps, as torch.distributed.pipelining runs the trainer's
schedule over train/pipeline_stage.LeanStage (measured per rank and schedule with saved-tensor hooks and the
stages' own state: tests/distributed/test_pipeline_memory.py, within 5%).

Per micro-batch in flight a chunk keeps:
    its layers           layers · (planner/activations.py's bytes per layer), offloaded layers none
                         (parallel.offload_layers: planner/offload.py) but the chunk's input, which stays
    its input            nothing more: the received buffer is its first block's (or the final norm's) saved input
    its output           nothing: a non-last chunk frees its output's data once sent (LeanStage, as Megatron-LM's
                         deallocate_output_tensor), keeping only its autograd node for backward
    the embedding        the token ids it saves (int64)
    the head             the final norm's input b·s·h (/t under SP), the head's input gathered whole b·s·h, the
                         logits b·s·V (TP's head all-gathers them: not /t) and the loss's fp32 log-softmax b·s·V
and a rank with a chunk that is not the last waits for one gradient (b·s·h, /t under SP) while a backward is due.
Megatron-LM computes the loss on vocab-parallel logits; those what-ifs (`native_trainer=False`) keep the layers and one micro-batch's logits only.
"""

from __future__ import annotations

from nightloom.parallel import ParallelDims
from nightloom.planner.inflight import in_flight_layers
from nightloom.shape import ModelShape

#: bytes of a token id the embedding saves for its backward (int64)
ID_BYTES = 8
#: bytes of the loss's saved log-softmax per logit (the trainer upcasts the logits to fp32 for the cross-entropy)
LOG_SOFTMAX_BYTES = 4


def chunk_input_bytes(shape: ModelShape, c: ParallelDims, seq: int, precision: str) -> float:
    """One micro-batch's input of a chunk: b·s·h activations (/t under SP)."""
    act_bytes = 4 if precision == "fp32" else 2
    return seq * c.micro_batch / c.cp * shape.hidden * act_bytes / (c.tp if c.sp else 1)


def head_bytes(shape: ModelShape, c: ParallelDims, seq: int, act_bytes: int) -> float:
    """What the head keeps per micro-batch: the final norm's input, its own input, the logits, the log-softmax."""
    tokens = seq * c.micro_batch / c.cp
    head = tokens * shape.hidden * act_bytes / (c.tp if c.sp else 1) + tokens * shape.hidden * act_bytes
    return head + tokens * shape.embed_rows * act_bytes + tokens * shape.vocab * LOG_SOFTMAX_BYTES


def chunk_bytes(shape: ModelShape, c: ParallelDims, seq: int, layer_bytes: float, act_bytes: int) -> tuple[float, ...]:
    """Bytes one micro-batch keeps on each of the pp·v chunks (model order) while it is in flight."""
    tokens = seq * c.micro_batch / c.cp
    boundary = tokens * shape.hidden * act_bytes / (c.tp if c.sp else 1)
    sizes, offloaded = c.stage_sizes(shape.layers), c.offloaded_per_chunk(shape.layers)
    head = head_bytes(shape, c, seq, act_bytes)
    out = []
    for j, (n, k) in enumerate(zip(sizes, offloaded)):
        # offloaded layers (planner/offload.py) keep nothing here but the chunk's input (received, or embedded)
        held = (n - k) * layer_bytes + (boundary if k else 0.0) + (head if j == len(sizes) - 1 else 0.0)
        if j == 0:
            held += tokens * ID_BYTES
        out.append(held)
    return tuple(out)


def rank_activation_bytes(
    shape: ModelShape, c: ParallelDims, seq: int, layer_bytes: float, act_bytes: int
) -> tuple[float, ...]:
    """Peak activation bytes of every pipeline rank (pp > 1) under nightloom's trainer."""
    chunks = chunk_bytes(shape, c, seq, layer_bytes, act_bytes)
    peaks = in_flight_layers(chunks, c.pp, c.grad_accum, c.schedule)
    grad = seq * c.micro_batch / c.cp * shape.hidden * act_bytes / (c.tp if c.sp else 1)
    back = _prefetch_bytes(shape, c, layer_bytes, head_bytes(shape, c, seq, act_bytes))
    owner = [c.chunk_rank(j) for j in range(len(chunks))]  # once: the search calls this ~10^5 times at pp 64
    waits = set(owner[:-1])  # a rank waits for one gradient while it holds a chunk that is not the model's last
    most_back = [0.0] * len(peaks)  # prefetch bytes are >= 0 and every rank holds a chunk
    for j, r in enumerate(owner):
        most_back[r] = max(most_back[r], back[j])
    return tuple(p + (grad if r in waits else 0.0) + most_back[r] for r, p in enumerate(peaks))


def _prefetch_bytes(shape: ModelShape, c: ParallelDims, layer_bytes: float, head: float) -> tuple[float, ...]:
    """Per chunk, what offloaded layers brought back add to its peak (train/offload.py): a layer returns as the next
    layer's backward begins, by when only the chunk's later layers are freed, so with one layer after the offloaded
    ones one layer comes on top, and with none (the chunk's last layer offloaded, it and the one before return as
    the chunk's backward begins) two; the model's last chunk has freed its head (`head`) first."""
    sizes, offloaded = c.stage_sizes(shape.layers), c.offloaded_per_chunk(shape.layers)
    out = []
    for j, (n, k) in enumerate(zip(sizes, offloaded)):
        back = 0 if not k or n - k > 1 else (1 if n - k == 1 else min(2, n))
        out.append(max(0.0, back * layer_bytes - (head if j == len(sizes) - 1 else 0.0)))
    return tuple(out)


def other_trainer_bytes(
    shape: ModelShape, c: ParallelDims, layer_bytes: float, last_logits: float
) -> tuple[float, ...]:
    """Megatron-style trainers (and any trainer without a pipeline): the layers of the micro-batches in flight,
    one micro-batch's logits on the last rank (outputs freed once sent, vocab-parallel loss)."""
    resident = tuple(n - k for n, k in zip(c.stage_sizes(shape.layers), c.offloaded_per_chunk(shape.layers)))
    layers = in_flight_layers(resident, c.pp, c.grad_accum, c.schedule)
    return tuple(n * layer_bytes + (last_logits if r == c.head_rank else 0.0) for r, n in enumerate(layers))


def rank_bytes(
    shape: ModelShape,
    c: ParallelDims,
    seq: int,
    layer_bytes: float,
    precision: str,
    native_trainer: bool,
    last_logits: float,
) -> tuple[float, ...]:
    """Activation bytes of every pipeline rank: nightloom's pipeline (`rank_activation_bytes`), else the layers in
    flight and `last_logits` (no pipeline, or another trainer's)."""
    if native_trainer and c.pp > 1:
        return rank_activation_bytes(shape, c, seq, layer_bytes, 4 if precision == "fp32" else 2)
    return other_trainer_bytes(shape, c, layer_bytes, last_logits)
