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
from typing import Literal

from nightloom.catalog import GPUSpec
from nightloom.parallel import MemoryBreakdown, ParallelDims
from nightloom.planner.generation import Generation, element_bytes, generation, no_grad_forward_s
from nightloom.planner.memory import FRAMEWORK_OVERHEAD_GIB, GIB, LOGIT_BYTES, logit_bytes, stage_params
from nightloom.planner.steptime import StepEstimate
from nightloom.records import Record
from nightloom.shape import ModelShape

Reference = Literal["none", "adapters_off", "precomputed", "frozen_copy"]


@dataclass(frozen=True)
class PostTraining:
    """The post-training task a plan prices. `reference`: how DPO's (or GRPO's KL) reference log-probs are had;
    `steps`: the run's optimizer steps (a precomputed reference scores steps · global_batch pairs once); GRPO's
    `prompts` · `group` completions of `completion` tokens generated every `iterations` steps."""

    task: Literal["dpo", "grpo"]
    reference: Reference = "none"
    steps: int = 1
    prompts: int = 0
    group: int = 1
    completion: int = 0
    iterations: int = 1
    vllm_share: float = 0.0  # train.grpo.engine vllm: the share of each GPU vLLM holds (0: native rollouts)
    vllm_sleep: bool = False  # vLLM's memory freed while the trainer runs (train.grpo.vllm.sleep)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.iterations < 1:
            raise ValueError(f"post-training: steps ({self.steps}) and iterations ({self.iterations}) must be >= 1")
        if self.task == "grpo" and (self.prompts < 1 or self.group < 1 or self.completion < 1):
            raise ValueError("grpo: prompts, group and completion tokens must be >= 1")

    @property
    def rows(self) -> int:
        """Training rows per item of the global batch: a DPO pair is 2 rows, a GRPO completion 1."""
        return 2 if self.task == "dpo" else 1

    @property
    def sequences(self) -> int:
        """GRPO's training sequences per step: every completion of every prompt."""
        return self.prompts * self.group


def post_training_of(train) -> PostTraining | None:
    """The spec's train section as the planner's task (None for pretrain and sft: priced as they are)."""
    task = getattr(train, "task", None)
    lora = getattr(train, "lora", None) is not None
    if task == "dpo":
        from nightloom.spec.preference import PreferenceSpec

        how = (train.preference or PreferenceSpec()).reference_how(lora)
        return PostTraining("dpo", how, steps=train.steps)
    if task == "grpo":
        from nightloom.spec.grpo import GRPOSpec

        g = train.grpo or GRPOSpec()
        return PostTraining(
            "grpo",
            "adapters_off" if g.beta > 0 else "none",
            steps=train.steps,
            prompts=g.prompts_per_step,
            group=g.num_generations,
            completion=g.max_completion_tokens,
            iterations=g.iterations,
            vllm_share=g.vllm_settings.gpu_memory_utilization if g.engine == "vllm" else 0.0,
            vllm_sleep=g.engine == "vllm" and g.vllm_settings.sleep,
        )
    return None


class TaskSplit(Record):
    """A post-training step's parts (seconds per optimizer step unless named otherwise) and its extra memory."""

    task: str
    reference: str = "none"
    step_s: float
    training_s: float  # forward and backward of the step's rows (both rows of every pair)
    reference_s: float = 0.0  # the reference's no-grad forward per step (DPO precomputed: its pass / steps)
    once_s: float = 0.0  # DPO precomputed: the pass before the first step
    generation_s: float = 0.0  # GRPO: one rollout (prefill + decode + gather), every `iterations` steps
    prefill_s: float = 0.0
    decode_s: float = 0.0
    gather_s: float = 0.0
    decode_bound: str = ""
    scoring_s: float = 0.0  # GRPO: per rollout; the reward functions run on the host (not modelled: 0)
    iterations: int = 1
    rollout_rows: int = 0  # GRPO: completions generated on one rank per rollout
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reference_gib: float = 0.0  # DPO frozen copy: its weights per GPU
    kv_cache_gib: float = 0.0
    rollout_gib: float = 0.0  # what the rollout holds beyond the states (gathered weights, KV cache, prefill)
    training_activations_gib: float = 0.0

    @property
    def per_step(self) -> dict[str, float]:
        """Generation, scoring and training in seconds per optimizer step (GRPO's split)."""
        k = self.iterations
        training = self.training_s + self.reference_s
        return {"generation": self.generation_s / k, "scoring": self.scoring_s / k, "training": training}


def task_dims(task: PostTraining | None, c: ParallelDims) -> ParallelDims:
    """The layout as the step's forward sees it: a DPO micro-batch of mb pairs is 2·mb rows."""
    if task is None or task.rows == 1:
        return c
    return dataclasses.replace(c, micro_batch=c.micro_batch * task.rows)


def splits_groups(task: PostTraining | None, c: ParallelDims) -> bool:
    """Would layout `c` split a GRPO group over data-parallel ranks? Each rank holds whole groups: the trainer
    refuses prompts_per_step not a multiple of dp (train/rollout/prompts.py)."""
    return task is not None and task.task == "grpo" and task.prompts % c.dp != 0


def grpo_prompt_tokens(task: PostTraining, seq: int) -> int:
    """A GRPO prompt's tokens: train.seq_len bounds a prompt and its completion (at least one prompt token)."""
    return max(1, seq - task.completion)


def _rollout(task: PostTraining, shape: ModelShape, c: ParallelDims, seq: int, gpu: GPUSpec, gpn: int, eff, prec):
    rows = max(1, task.sequences // c.dp)  # each DP rank generates its share of the groups
    return generation(shape, c, rows, grpo_prompt_tokens(task, seq), task.completion, gpu, gpn, eff, prec)


@dataclass(frozen=True)
class TaskMemory:
    """A post-training step's own memory terms on one GPU (GiB): the training step's activations with every
    token's logits, a frozen reference copy's weights, and what a GRPO rollout holds beyond the states."""

    training_activations_gib: float
    reference_gib: float = 0.0
    rollout_gib: float = 0.0


def task_memory(
    task: PostTraining | None,
    shape: ModelShape,
    c: ParallelDims,
    seq: int,
    mem: MemoryBreakdown,
    precision: str = "bf16",
    gpu: GPUSpec | None = None,
    gpn: int = 8,
) -> tuple[MemoryBreakdown, TaskMemory | None]:
    """`mem` (memory_breakdown of `task_dims(task, c)`) with the task's own terms: every token's fp32 logits where
    the trainer would have chunked them (the step scores every completion token), a frozen reference copy's
    weights, and GRPO's rollout where it needs more than the training step's activations; with the vllm engine the
    rollout is vLLM's share of the GPU (gpu_memory_utilization), held beside the training step (its overhead) unless
    vLLM sleeps while the trainer runs."""
    if task is None:
        return mem, None
    rows = task_dims(task, c)
    full = LOGIT_BYTES * seq * rows.micro_batch * shape.vocab / c.tp
    acts = mem.activations_gib + (full - logit_bytes(shape, rows, seq)) / GIB
    parts = TaskMemory(training_activations_gib=acts)
    if task.reference == "frozen_copy":  # 16-bit weights, sharded over the same ranks as the policy's
        copy = stage_params(shape, c.tp, 1, c.ep)[0] * element_bytes(precision) / c.shard / GIB
        parts = dataclasses.replace(parts, reference_gib=copy)
    if task.task == "grpo" and gpu is not None and task.vllm_share:  # vLLM's share holds the rollout
        parts = dataclasses.replace(parts, rollout_gib=task.vllm_share * gpu.memory_gib)
    elif task.task == "grpo" and gpu is not None:
        gen = _rollout(task, shape, c, seq, gpu, gpn, 1.0, precision)
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
    task: PostTraining | None,
    shape: ModelShape,
    c: ParallelDims,
    seq: int,
    est: StepEstimate,
    global_batch: int,
    gpu: GPUSpec,
    gpn: int,
    efficiency: float,
    precision: str = "bf16",
    memory: TaskMemory | None = None,
) -> tuple[StepEstimate, TaskSplit | None]:
    """`est` (step_time of `task_dims(task, c)`, the training rows) with the task's other parts added to the step
    time, and their split (with `memory`'s figures, task_memory's). DPO: the reference's forward of both rows of
    the rank's pairs; GRPO: (generation + scoring) / iterations, and beta's reference forward every step."""
    if task is None:
        return est, None
    split = TaskSplit(task=task.task, reference=task.reference, step_s=est.step_s, training_s=est.step_s)
    if memory is not None:
        split = split.model_copy(update=dataclasses.asdict(memory))
    if task.task == "dpo":
        if task.reference != "none":
            rows = task.rows * global_batch // c.dp
            ref = no_grad_forward_s(shape, c, rows, task.rows * c.micro_batch, seq, gpu, gpn, efficiency, precision)
            once = ref * task.steps if task.reference == "precomputed" else 0.0
            split = split.model_copy(update={"reference_s": ref, "once_s": once})
        extra = split.reference_s
    else:
        gen = _rollout(task, shape, c, seq, gpu, gpn, efficiency, precision)
        scoring, ref = 0.0, 0.0
        if task.reference != "none":  # beta > 0: the base's forward of each micro-batch, every step
            ref = no_grad_forward_s(shape, c, gen.rows, c.micro_batch, seq, gpu, gpn, efficiency, precision)
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


def explain_lines(split: TaskSplit | None) -> list[str]:
    """The plan printout's lines for a post-training step (none for pretrain and sft)."""
    if split is None:
        return []
    if split.task == "dpo":
        return [_dpo_line(split)]
    per = split.per_step
    total = sum(per.values())
    parts = ", ".join(f"{k} {v:.3f} s ({v / total:.0%})" for k, v in per.items())
    return [
        f"grpo step {split.step_s:.3f} s = {parts}; a rollout every {split.iterations} step(s): "
        f"{split.rollout_rows} completions a rank, {split.prompt_tokens} prompt + {split.completion_tokens} "
        f"completion tokens: prefill {split.prefill_s:.3f} s (compute-bound), decode {split.decode_s:.3f} s "
        f"({split.decode_bound}-bound: weights and KV cache read every token), FSDP2 gather {split.gather_s:.3f} s; "
        "scoring: the reward functions on the host, not modelled; training: "
        + (
            f"with the KL reference's no-grad forward (adapters off) {split.reference_s:.3f} s"
            if split.reference != "none"
            else "no reference (beta 0)"
        ),
        f"grpo memory: the rollout holds {split.rollout_gib:.2f} GiB per GPU beyond the states (KV cache "
        f"{split.kv_cache_gib:.2f} GiB: 2·layers·kv_heads·head_dim·bytes a token; the prefill's MLP; under FSDP2 the "
        f"gathered weights), training activations {split.training_activations_gib:.2f} GiB (every token's logits): "
        "the activations column is the larger",
    ]


def _dpo_line(split: TaskSplit) -> str:
    head = (
        f"dpo: 2 rows a pair in one forward (chosen, rejected; every token's logits): training {split.training_s:.3f} s"
    )
    if split.reference == "none":
        return head + "; reference-free loss: no reference pass"
    if split.reference == "precomputed":
        return head + (
            f"; the reference precomputed before the first step: {split.once_s:.1f} s once (a no-grad forward of "
            f"the pairs the run reads), {split.reference_s:.3f} s per step spread over the steps; no device memory "
            "during training (the table is in host memory)"
        )
    if split.reference == "frozen_copy":
        return head + (
            f"; the reference a frozen copy sharded as the policy: {split.reference_gib:.2f} GiB per GPU, its "
            f"no-grad forward {split.reference_s:.3f} s per step"
        )
    return (
        head
        + f"; the reference with the adapters off (no second copy): a no-grad forward, {split.reference_s:.3f} s per step"
    )
