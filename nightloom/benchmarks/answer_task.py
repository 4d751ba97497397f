"""A demo's generative task, built on first use from held-out prompts that carry their `answer` (a GRPO run's
verifiable answers, dataset.keep_columns): lm-eval generates a few greedy tokens after each prompt (generate_until)
and scores them as the demo's reward reads a completion:

- `exact_match`: the completion begins with the answer (the grpo-demo's one-digit sums: its first character);
- `digits`: the share of the completion's characters that are digits (the reward's other half).

A random base answers neither; a model that learned to answer in digits scores `digits` near 1 while
`exact_match` stays near chance when it did not learn the sums. Both are lm-eval metrics of one task (its
`process_results`, which a file beside the task's YAML imports from here), so `lm_eval` run by hand on the folder
gives the same scores.
"""

from __future__ import annotations

import json
from pathlib import Path

from nightloom.util import atomic_write_text

ANSWER = "answer"  # the held-out column with the expected answer


def answer_docs(prompts: list[str], answers: list) -> list[dict]:
    """One document per prompt with a non-empty answer (stringified, stripped)."""
    docs = []
    for p, a in zip(prompts, answers, strict=True):
        if p and a is not None and str(a).strip():
            docs.append({"prompt": p, ANSWER: str(a).strip()})
    return docs


def completion_scores(completion: str, answer: str) -> dict[str, float]:
    """The two metrics of one greedy completion (see the module's docstring)."""
    share = sum(c.isdigit() for c in completion) / max(len(completion), 1)
    return {"exact_match": float(completion.startswith(answer)), "digits": share}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's `process_results` of the task: the (filtered) completion against the document's answer."""
    return completion_scores(results[0], doc[ANSWER])


def metrics_module(name: str) -> str:
    """The file name (no .py) of the shim beside the YAML that lm-eval's `!function` loads."""
    return f"{name}_metrics"


def task_yaml(name: str, max_tokens: int) -> str:
    """The task's YAML: data beside it (`<name>.jsonl`), greedy generation of at most `max_tokens` tokens right
    after the prompt (no newline in the prompts: a newline ends it, as does the EOS), both metrics as means."""
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {name}.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        f"target_delimiter: ''\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: {max_tokens}\n"
        "  do_sample: false\n"
        f"process_results: !function {metrics_module(name)}.process_results\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: digits\n    aggregation: mean\n    higher_is_better: true\n"
    )


def ensure_answer_task(folder: str | Path, name: str, prompts: list[str], answers: list, max_tokens: int) -> int | None:
    """Write `<name>.jsonl`, the metrics shim, then `<name>.yaml` (last: a folder with the YAML is whole) unless the
    YAML is there; the documents written, None when it was there already. ValueError when no prompt has an
    answer."""
    folder = Path(folder)
    if (folder / f"{name}.yaml").is_file():
        return None
    docs = answer_docs(prompts, answers)
    if not docs:
        raise ValueError(f"validate.benchmarks.demo_task {name!r}: no held-out prompt with an {ANSWER!r} to build it")
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"{name}.jsonl", "".join(json.dumps(d) + "\n" for d in docs))
    shim = f'"""{name}\'s metrics (nightloom wrote this file)."""\n\nfrom {__name__} import process_results  # noqa: F401\n'
    atomic_write_text(folder / f"{metrics_module(name)}.py", shim)
    atomic_write_text(folder / f"{name}.yaml", task_yaml(name, max_tokens))
    return len(docs)
