"""How a rank's share of the global batch is cut into micro-batches on the XTuner backend: a rule the spec checks
at load time (before anything is rented) and the XTuner planner applies, so it lives below both (no imports).
"""

from __future__ import annotations


def micro_batches_per_step(
    global_batch: int, world: int, micro_batch: int | None, zero_stage: int = 0, sp: int = 1
) -> int:
    """Forward/backward passes per rank per step: the rank's share of the global batch (global_batch / world) in
    micro-batches of `micro_batch` sequences (default: all of it in one). ValueError naming the field when
    it does not divide, or when accumulation meets a layout that brings its own (DeepSpeed, sequence parallel)."""
    if global_batch % world:
        raise ValueError(
            f"train.global_batch: {global_batch} is not divisible by the world size {world} "
            "(each XTuner rank takes global_batch / world sequences per step)"
        )
    per_rank = global_batch // world
    micro = micro_batch or per_rank
    if per_rank % micro:
        raise ValueError(
            f"train.xtuner.micro_batch: {micro} does not divide the {per_rank} sequences a rank takes per step "
            f"(train.global_batch {global_batch} / {world} ranks)"
        )
    k = per_rank // micro
    if k > 1 and zero_stage:
        raise ValueError(
            f"train.xtuner.micro_batch: {k} micro-batches per step with zero_stage {zero_stage}: DeepSpeed runs take "
            "their own strategy, not nightloom's micro-batch wrapper; use micro_batch = global_batch / world size "
            "(or zero_stage 0)"
        )
    if k > 1 and sp > 1:
        raise ValueError(
            f"train.xtuner.micro_batch: {k} micro-batches per step with sequence_parallel_size {sp} is not supported"
        )
    return k
