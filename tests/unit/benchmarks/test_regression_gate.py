"""A planted regression: a model that learned the right answers is the base; the same model trained further on
shuffled answers is the tuned one. lm-eval scores both (one process, real models) on the demos' task (each answer
among its own words shuffled); the max-drop gate fails naming the task and the drop, the export is marked, the
flow's error and the ledger row say which task and by how much, and the base's scores are cached."""

from __future__ import annotations

import json
from pathlib import Path

from nightloom.benchmarks.demo_task import ensure_demo_task
from nightloom.benchmarks.launch import run_benchmarks
from nightloom.benchmarks.stage import FAILED_MARK, report
from nightloom.ledger import Ledger
from nightloom.spec.benchmarks import BenchmarksSpec
from nightloom.validate import ValidationFailed
from tests.support.benchmarks import qa_pairs, tiny_model

TASK = "demo_mc"


def _chatml(q: str, a: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"


def _train(model_dir: Path, texts: list[str], out: Path, steps: int = 60) -> Path:
    """Full-batch AdamW on the texts (every token a label), saved with the tokenizer: a real model that learned them."""
    import shutil

    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    batch = tok(texts, return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    for f in model_dir.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def test_a_model_tuned_on_shuffled_answers_fails_its_max_drop_gate(tmp_path):
    pairs = [(q, a + " " + q.split()[1]) for q, a in qa_pairs(16)]  # 4-word answers: three other orders each
    folder = tmp_path / "tasks"
    assert ensure_demo_task(folder, TASK, [_chatml(q, a) for q, a in pairs]) == 16
    docs = [json.loads(line) for line in (folder / f"{TASK}.jsonl").read_text().splitlines()]
    wrong = [d["choices"][(d["gold"] + 1) % 4] for d in docs]  # a shuffled answer of each question
    start = tiny_model(tmp_path / "random")
    base = _train(start, [_chatml(d["question"], d["choices"][d["gold"]]) for d in docs], tmp_path / "base")
    tuned = _train(base, [_chatml(d["question"], w) for d, w in zip(docs, wrong, strict=True)], tmp_path / "tuned")

    gate = {"task": TASK, "metric": "acc", "max_drop": 0.1}
    settings = BenchmarksSpec(tasks=[TASK], include_path=str(folder), apply_chat_template=True, gates=[gate])
    run_dir = tmp_path / "runs" / "run-1"
    result = run_benchmarks(settings, str(tuned), str(base), run_dir, tmp_path / "runs" / ".benchmarks", [])
    rep = report(settings, result, run_dir, tuned)

    acc = next(r for r in rep.rows if r.metric == "acc")
    assert acc.base >= 0.75 and acc.tuned <= 0.25, acc  # the base learned the answers; the tuned one unlearned them
    [verdict] = rep.verdicts
    assert not verdict.passed and verdict.name == f"bench:{TASK}/acc:max_drop", verdict
    assert f"{TASK} acc: base {acc.base:.4f} -> tuned {acc.tuned:.4f}, drop {acc.base - acc.tuned:.4f} > 0.1" in (
        verdict.reason
    )
    assert json.loads((tuned / FAILED_MARK).read_text())["failed"][0]["name"] == verdict.name  # kept, marked
    assert f"{verdict.name}: {verdict.reason}" in str(ValidationFailed([verdict]))  # the flow's error

    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        ledger.start_run(
            run_id="r1", spec_hash="h", name="n", model="m", cluster="c", provider="local", gpu_type="cpu", world_size=1
        )
        ledger.finish_run("r1", status="failed", verdicts=rep.verdicts, figures=rep.figures)
        row = ledger.get("r1")
    assert row.status == "failed" and row.verdicts[0].reason == verdict.reason
    assert {f.name: (f.base, f.value) for f in row.figures}[f"bench/{TASK}/acc"] == (acc.base, acc.tuned)

    [cached] = (tmp_path / "runs" / ".benchmarks").glob("base-*.json")  # the next night does not score the base
    assert json.loads(cached.read_text())["scores"] == [s.model_dump() for s in result.base.scores]
