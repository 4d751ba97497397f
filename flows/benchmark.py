"""benchmark-run: lm-evaluation-harness tasks on any run folder's export (and a base beside it), the deployment
behind `nightloom eval RUN --tasks ...`; the table is the flow's `benchmarks` artifact."""

from __future__ import annotations

from typing import Literal

from prefect import flow

from nightloom.benchmarks.compare import BenchRow
from nightloom.spec.benchmarks import BenchmarksSpec
from tasks.benchmarks import benchmark_folder_task


@flow(name="benchmark-run", log_prints=True)
def benchmark_run(
    run_dir: str,
    tasks: list[str],
    include_path: str | None = None,
    base: str | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    apply_chat_template: bool = False,
    backend: Literal["auto", "hf", "vllm"] = "auto",
) -> list[BenchRow]:
    """Score a run's export on lm-eval tasks, offline.

    Args:
        run_dir: The run folder (its export/ is scored), from the repository root or absolute.
        tasks: lm-eval task names (built in, or in include_path).
        include_path: A folder of your task YAMLs.
        base: A Hugging Face folder scored beside the export (with the export's tokenizer); its scores are cached.
        num_fewshot: Few-shot examples (default: each task's own).
        limit: Examples per task: a count, or a fraction below 1.
        apply_chat_template: Prompts through the tokenizer's chat template.
        backend: lm-eval's backend on the node: hf, vllm (tensor parallel over the GPUs), auto (vllm where
            installed on a GPU node).
    """
    settings = BenchmarksSpec(
        tasks=tasks,
        include_path=include_path,
        num_fewshot=num_fewshot,
        limit=limit,
        apply_chat_template=apply_chat_template,
        backend=backend,
        base=base is not None,
        completions=0,
    )
    return benchmark_folder_task(run_dir, settings, base)
