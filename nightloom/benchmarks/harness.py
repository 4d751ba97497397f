"""lm-evaluation-harness on one Hugging Face folder, in this process: `lm_eval.simple_evaluate` with its HF or vLLM
backend (`engine.py` chooses, on the node) and a `TaskManager` over the user's task folder, offline; lm-eval's
results dict -> `Score` records.

Run it in the task folder (`launch.py` does): lm-eval resolves a relative `data_files` against the current
folder, not the YAML's.
"""

from __future__ import annotations

import os
from typing import Literal

from nightloom.benchmarks.engine import node_engine
from nightloom.benchmarks.records import BenchJob, Score

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
_NOT_METRICS = {"alias", "name", "sample_len", "samples"}


def model_args(model_dir: str, tokenizer: str | None, backend: Literal["auto", "hf", "vllm"] = "hf") -> dict:
    """lm-eval's `model_args` for a folder on this node (`engine.node_engine`: where it goes, the dtype) with the
    tokenizer folder (the export's, for a base whose weights folder holds none)."""
    return node_engine(model_dir, backend).model_args(model_dir, tokenizer)


def simple_evaluate_kwargs(job: BenchJob) -> dict:
    """lm_eval.simple_evaluate's settings from the job (the parity test calls it with the same ones)."""
    limit = None if job.limit is None else (int(job.limit) if job.limit >= 1 else job.limit)
    taken = {"tasks", "num_fewshot", "batch_size", "apply_chat_template", "fewshot_as_multiturn"}
    return job.model_dump(include=taken) | {"limit": limit, "log_samples": False}


def versions_only_env_info(results: dict) -> None:
    """What lm-eval's `add_env_info` records, but torch's `collect_env` report: that report runs pip, lscpu and
    nvidia-smi in subprocesses, 2.1-2.4 s per model on a 2-core machine (twice a run: base and tuned, in a stage of
    about 8 s), and nightloom keeps none of it. The scores are untouched (the parity tests check them)."""
    from importlib.metadata import version

    import transformers

    results |= {"pretty_env_info": "", "transformers_version": transformers.__version__}
    results |= {"lm_eval_version": version("lm_eval"), "upper_git_hash": None}


def evaluate(model_dir: str, job: BenchJob) -> list[Score]:
    """Score one model folder on the job's tasks with lm-eval, offline."""
    for k, v in OFFLINE.items():
        os.environ.setdefault(k, v)
    import lm_eval
    import lm_eval.evaluator

    lm_eval.evaluator.add_env_info = versions_only_env_info  # lm-eval 0.4.13 calls it by this module's name

    from nightloom.benchmarks.catalog import task_manager

    tm = task_manager(job.tasks, job.include_path)
    engine = node_engine(model_dir, job.backend)
    print(f"nightloom: lm-eval's {engine.backend} backend for {model_dir} ({engine.why})", flush=True)
    out = lm_eval.simple_evaluate(
        model=engine.backend,
        model_args=engine.model_args(model_dir, job.tokenizer),
        task_manager=tm,
        **simple_evaluate_kwargs(job),
    )
    return scores_from_results(out)


def scores_from_results(out: dict) -> list[Score]:
    """Every task's metrics from lm-eval's results: `acc,none` is `acc`, `exact_match,strict-match` keeps its
    filter; the stderr is `acc_stderr,none` (None where lm-eval wrote "N/A")."""
    samples = {t: n.get("effective") for t, n in (out.get("n-samples") or {}).items()}
    scores = []
    for task, row in sorted(out["results"].items()):
        for key, value in row.items():
            if key in _NOT_METRICS or "," not in key or "_stderr," in key:
                continue
            metric, flt = key.split(",", 1)
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            err = row.get(f"{metric}_stderr,{flt}")
            name = metric if flt == "none" else key
            stderr = float(err) if isinstance(err, int | float) else None
            scores.append(Score(task=task, metric=name, value=float(value), stderr=stderr, samples=samples.get(task)))
    return scores
