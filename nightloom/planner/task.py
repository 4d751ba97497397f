"""The post-training task a plan prices (train.task dpo or grpo, from the spec's train section) and the split of
its step the plan reports (TaskSplit, and the printout's lines for it); what the task costs in memory and time is
post_training.py's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from nightloom.parallel import ParallelDims
from nightloom.records import Record

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
