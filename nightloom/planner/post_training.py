"""What a post-training step costs beyond a pretraining step of the same rows, in memory and time, so that
`parallel: auto`, `nightloom plan`, the nights and the cost hold for train.task dpo and grpo.

DPO (train/preference/step.py): a global batch is pairs and every micro-batch is 2 rows a pair (chosen and rejected
in one forward), whose logits are all made (the log-probs of every completion token: no chunked loss). The
reference's log-probs (train/preference/reference.py) are a no-grad forward of both rows (generation.py's
`no_grad_forward_s`): every step with the adapters off (LoRA: the base itself, no second copy) or with a frozen
copy (its 16-bit weights sharded as the policy's), or once before training (precomputed: the pairs the run reads,
scored in one pass; on the device nothing during training, the table lives in host memory). The pass's time is
spread over the steps in the step time, so the cost and the nights count it.

GRPO (train/rollout/step.py): a step is generation + scoring + training. Every `iterations` optimizer steps one
batch of prompts_per_step · num_generations completions is generated (generation.py: prefill, memory-bound decode,
FSDP2's gather) and scored (the reward functions run on the host: not modelled); every step trains on the whole
batch (its rows priced as a pretraining step of train.seq_len tokens) and, with beta > 0, first runs the KL
reference's no-grad forward of each micro-batch with the adapters off (counted in training, as the trainer does). Memory: the training step's, or the rollout's where larger (the gathered weights, the KV
cache, the prefill's transients).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nightloom.parallel import MemoryBreakdown, ParallelDims
from nightloom.planner.generation import Generation, element_bytes, generation, no_grad_forward_s
from nightloom.planner.memory import FRAMEWORK_OVERHEAD_GIB, GIB, LOGIT_BYTES, logit_bytes, stage_params
from nightloom.planner.steptime import StepEstimate
from nightloom.planner.task import TaskSplit, grpo_prompt_tokens, task_dims

if TYPE_CHECKING:
    from nightloom.planner.request import PlanRequest


def _rollout(req: PlanRequest, c: ParallelDims, eff: float) -> Generation:
    task = req.task
    rows = max(1, task.sequences // c.dp)  # each DP rank generates its share of the groups
    prompt = grpo_prompt_tokens(task, req.seq_len)
    return generation(req.shape, c, rows, prompt, task.completion, req.gpu, req.gpus_per_node, eff, req.precision)


@dataclass(frozen=True)
class TaskMemory:
    """A post-training step's own memory terms on one GPU (GiB): the training step's activations with every
    token's logits, a frozen reference copy's weights, and what a GRPO rollout holds beyond the states."""

    training_activations_gib: float
    reference_gib: float = 0.0
    rollout_gib: float = 0.0


def task_memory(req: PlanRequest, c: ParallelDims, mem: MemoryBreakdown) -> tuple[MemoryBreakdown, TaskMemory | None]:
    """`mem` (memory_breakdown of `task_dims(req.task, c)`) with the task's own terms: every token's fp32 logits where
    the trainer would have chunked them (the step scores every completion token), a frozen reference copy's
    weights, and GRPO's rollout where it needs more than the training step's activations; with the vllm engine the
    rollout is vLLM's share of the GPU (gpu_memory_utilization), held beside the training step (its overhead) unless
    vLLM sleeps while the trainer runs."""
    task, shape, seq, gpu = req.task, req.shape, req.seq_len, req.gpu
    if task is None:
        return mem, None
    rows = task_dims(task, c)
    full = LOGIT_BYTES * seq * rows.micro_batch * shape.vocab / c.tp
    acts = mem.activations_gib + (full - logit_bytes(shape, rows, seq)) / GIB
    parts = TaskMemory(training_activations_gib=acts)
    if task.reference == "frozen_copy":  # 16-bit weights, sharded over the same ranks as the policy's
        copy = stage_params(shape, c.tp, 1, c.ep)[0] * element_bytes(req.precision) / c.shard / GIB
        parts = dataclasses.replace(parts, reference_gib=copy)
    if task.task == "grpo" and gpu is not None and task.vllm_share:  # vLLM's share holds the rollout
        parts = dataclasses.replace(parts, rollout_gib=task.vllm_share * gpu.memory_gib)
    elif task.task == "grpo" and gpu is not None:
        gen = _rollout(req, c, 1.0)
        parts = dataclasses.replace(parts, rollout_gib=_rollout_gib(gen, c, mem))
    beside = task.vllm_share > 0 and not task.vllm_sleep  # vLLM awake through the training step: both at once
    update = {
        "activations_gib": parts.training_activations_gib if beside else max(parts.training_activations_gib,
                                                                             parts.rollout_gib),
        "weights_gib": mem.weights_gib + parts.reference_gib,
        "overhead_gib": mem.overhead_gib + (parts.rollout_gib if beside else 0.0),
    }  # fmt: skip
    return mem.model_copy(update=update), parts


def _rollout_gib(gen: Generation, c: ParallelDims, mem: MemoryBreakdown) -> float:
    """The rollout's bytes beyond the states: the KV cache, the prefill's transients and, under FSDP2, the whole
    stage gathered (less the two layers the training step's working set already counts)."""
    gathered = 0.0
    if c.shard > 1:
        gathered = max(0.0, gen.weight_bytes / GIB - (mem.overhead_gib - FRAMEWORK_OVERHEAD_GIB))
    return (gen.kv_bytes + gen.working_bytes) / GIB + gathered


def task_step(
    req: PlanRequest, c: ParallelDims, est: StepEstimate, efficiency: float, memory: TaskMemory | None = None
) -> tuple[StepEstimate, TaskSplit | None]:
    """`est` (step_time of `task_dims(req.task, c)`, the training rows) with the task's other parts added to the step
    time, and their split (with `memory`'s figures, task_memory's). DPO: the reference's forward of both rows of
    the rank's pairs; GRPO: (generation + scoring) / iterations, and beta's reference forward every step."""
    task = req.task
    if task is None:
        return est, None
    split = TaskSplit(task=task.task, reference=task.reference, step_s=est.step_s, training_s=est.step_s)
    if memory is not None:
        split = split.model_copy(update=dataclasses.asdict(memory))
    if task.task == "dpo":
        if task.reference != "none":
            rows = task.rows * req.global_batch // c.dp
            ref = _reference_s(req, c, rows, task.rows * c.micro_batch, efficiency)
            once = ref * task.steps if task.reference == "precomputed" else 0.0
            split = split.model_copy(update={"reference_s": ref, "once_s": once})
        extra = split.reference_s
    else:
        gen = _rollout(req, c, efficiency)
        scoring, ref = 0.0, 0.0
        if task.reference != "none":  # beta > 0: the base's forward of each micro-batch, every step
            ref = _reference_s(req, c, gen.rows, c.micro_batch, efficiency)
        split = split.model_copy(
            update={
                "generation_s": gen.total_s,
                "prefill_s": gen.prefill_s,
                "decode_s": gen.decode_s,
                "gather_s": gen.gather_s,
                "decode_bound": gen.decode_bound,
                "scoring_s": scoring,
                "reference_s": ref,
                "iterations": task.iterations,
                "rollout_rows": gen.rows,
                "prompt_tokens": gen.prompt,
                "completion_tokens": gen.completion,
                "kv_cache_gib": gen.kv_bytes / GIB,
            }
        )
        extra = (gen.total_s + scoring) / task.iterations + ref
    step = dataclasses.replace(est, step_s=est.step_s + extra)
    return step, split.model_copy(update={"step_s": step.step_s})


def _reference_s(req: PlanRequest, c: ParallelDims, rows: int, micro_rows: int, eff: float) -> float:
    """The reference's no-grad forward of a rank's `rows` in micro-batches of `micro_rows` (seconds)."""
    return no_grad_forward_s(
        req.shape, c, rows, micro_rows, req.seq_len, req.gpu, req.gpus_per_node, eff, req.precision
    )
