"""Task benchmarks: lm-evaluation-harness on a run's export and on its base, side by side, and their gates.

`harness` runs lm-eval in one process (`python -m nightloom.benchmarks --job FILE`), `launch` starts that process
in the task folder with no network and caches the base's scores, `compare` pairs base and tuned and judges the
gates, `catalog` checks task names and their data at validate, `completions` and `demo_task` serve the side-by-side
table and the demos. No Prefect here: tasks/benchmarks.py is the thin task around it.
"""

from nightloom.benchmarks.records import BenchJob, BenchResult, Completion, ModelScores, Score

__all__ = ["BenchJob", "BenchResult", "Completion", "ModelScores", "Score"]
