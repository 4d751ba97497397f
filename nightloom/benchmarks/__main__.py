"""`python -m nightloom.benchmarks --job FILE`: score every model of a BenchJob with lm-eval, complete its prompts,
and write the list of ModelScores to the job's output (whole, then renamed). It works in the job's task folder,
wherever it was started (a node's shell starts it in its own work folder)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from nightloom.benchmarks.completions import complete
from nightloom.benchmarks.harness import evaluate
from nightloom.benchmarks.records import BenchJob, ModelScores
from nightloom.util import atomic_write_text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nightloom.benchmarks")
    p.add_argument("--job", required=True, help="a BenchJob as JSON")
    job = BenchJob.model_validate_json(Path(p.parse_args(argv).job).read_text())
    if job.include_path:  # lm-eval reads a task's relative data_files against the current folder
        os.chdir(job.include_path)
    results = []
    for model_dir in job.models:
        t0 = time.perf_counter()
        scores = evaluate(model_dir, job)
        texts = complete(model_dir, job.tokenizer, job.prompts, job.max_new_tokens)
        results.append(
            ModelScores(model_dir=model_dir, scores=scores, completions=texts, seconds=time.perf_counter() - t0)
        )
    atomic_write_text(Path(job.output), json.dumps([r.model_dump() for r in results], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
