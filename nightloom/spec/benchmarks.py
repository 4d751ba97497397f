"""The validate.benchmarks section: lm-evaluation-harness tasks run on the export and the base, and their gates.

A leaf of the spec package (floor 0): it imports only the section base. The tasks are checked against lm-eval's
index (unknown names, data that needs the network) by `nightloom.benchmarks.catalog`, at validate.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nightloom.spec.base import Section as _Section


class BenchGateSpec(_Section):
    """A gate on one task's metric: a floor, a least gain over the base, a most drop from the base."""

    task: str = Field(..., description="A task of `tasks` (its name as lm-eval reports it).")
    metric: str = Field("acc", description="The metric as lm-eval names it (acc, acc_norm, exact_match, ...).")
    min: float | None = Field(None, description="Gate: the tuned score is at least this.")
    min_gain: float | None = Field(None, description="Gate: tuned minus base is at least this (absolute).")
    max_drop: float | None = Field(None, ge=0, description="Gate: base minus tuned is at most this (absolute).")

    @model_validator(mode="after")
    def _one_bound(self):
        if self.min is None and self.min_gain is None and self.max_drop is None:
            raise ValueError("a benchmark gate needs min, min_gain or max_drop")
        return self


class BenchmarksSpec(_Section):
    """Task benchmarks (lm-evaluation-harness) on the exported model and once on the base, side by side."""

    tasks: list[str] = Field(..., min_length=1, description="lm-eval task names (built in or in `include_path`).")
    include_path: str | None = Field(
        None,
        description="A folder of the user's task YAMLs (relative to the spec). lm-eval runs in it, so relative "
        "`data_files` resolve against it.",
    )
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples (default: each task's own).")
    limit: float | None = Field(None, gt=0, description="Examples per task: a count (>= 1) or a fraction (< 1).")
    apply_chat_template: bool = Field(False, description="Render prompts with the tokenizer's chat template.")
    fewshot_as_multiturn: bool = Field(False, description="Few-shot examples as chat turns (needs the template).")
    batch_size: int = Field(8, ge=1, description="lm-eval's batch size.")
    backend: Literal["auto", "hf", "vllm"] = Field(
        "auto",
        description="lm-eval's backend on the node: hf (one device, or spread over the GPUs when the weights pass "
        "80% of one), vllm (tensor parallel over the GPUs the weights need; needs vllm on the node), auto (vllm "
        "where installed on a GPU node, else hf).",
    )
    base: bool = Field(True, description="Also score the base model (once per base and settings, cached).")
    gates: list[BenchGateSpec] = Field(default_factory=list, description="Gates on the tasks' metrics.")
    prompts: list[str] = Field(
        default_factory=list, description="Prompts completed by base and tuned side by side (default: held-out chats)."
    )
    completions: int = Field(3, ge=0, description="How many prompts to complete side by side (0 = none).")
    max_new_tokens: int = Field(32, ge=1, description="Greedy tokens per side-by-side completion.")
    demo_task: str | None = Field(
        None,
        description="Build this task in `include_path` on first use (demos): multiple choice from the held-out chats, "
        "or, when the held-out prompts carry an `answer` column (GRPO), generative with exact_match and digits.",
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ValueError("fewshot_as_multiturn needs apply_chat_template: true")
        if self.limit is not None and self.limit > 1 and self.limit != int(self.limit):
            raise ValueError(f"limit {self.limit}: a count (a whole number) or a fraction below 1")
        for i, g in enumerate(self.gates):
            if g.task not in self.tasks:
                raise ValueError(f"gates[{i}].task {g.task!r} is not one of tasks {self.tasks}")
            if (g.min_gain is not None or g.max_drop is not None) and not self.base:
                raise ValueError(f"gates[{i}]: min_gain and max_drop compare with the base: set base: true")
        if self.demo_task is not None and (self.include_path is None or self.demo_task not in self.tasks):
            raise ValueError("demo_task is built in include_path and must be one of tasks")
        return self
