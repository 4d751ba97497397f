"""A planted regression through the real pipeline: the chat demo's settings (its ChatML BPE trained on first use,
its Qwen2, LoRA on every linear, packed conversations, its benchmark task and max_drop gate), but the base has
learned the right answers and the run trains on shuffled ones (each answer's own words in another order, one of
the task's wrong choices). `nightloom run` exits 1, the flow run is Failed naming the gate, the export is kept and
marked, the ledger row is failed with the verdict (task, metric, base -> tuned, the drop) and the figures, and
the base's scores are cached for the next night."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from tests.support.benchmarks import chatml, train_on

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "deployments" / "chat-sft-demo.yaml"
TASK = "chat_sft_demo_mc"
GATE = f"bench:{TASK}/acc:max_drop"


def _cli(args: list[str]) -> tuple[int, str]:
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(args)
    return rc, buf.getvalue()


def _flow_run(run_id: str):
    """The pipeline's flow run whose id the run id ends with (make_run_id: name-stamp-<first 8 of the id>)."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    from tests.support.prefect_server import client

    with client() as c:
        runs = c.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["training-pipeline"])))
    (fr,) = [r for r in runs if run_id.endswith(str(r.id)[:8])]
    return fr


def _short_pairs(n: int) -> list[tuple[str, str]]:
    """The chat demo's first n single-turn conversations whose answer is one line of 5-9 words."""
    from nightloom.sharding.corpus import chat_records

    out = []
    for rec in chat_records():
        turns = [m for m in rec["messages"] if m["role"] != "system"]
        answer = turns[1]["content"] if len(turns) == 2 else ""
        if 5 <= len(answer.split()) <= 9 and "\n" not in answer:
            out.append((turns[0]["content"], answer))
        if len(out) == n:
            return out
    raise AssertionError(f"only {len(out)} short conversations")


def _planted(tmp_path: Path) -> dict:
    """The demo's spec with its data built here: the task (the true answers among their shuffles), the shuffled
    chats the run trains on, the demo's tokenizer trained on them, and a base that learned the true answers."""
    from nightloom.benchmarks.demo_task import ensure_demo_task
    from nightloom.hf.random_model import ensure_demo_weights
    from nightloom.spec.load import load_spec
    from nightloom.tokenizer import prepare_chat_tokenizer

    pairs = _short_pairs(16)
    tasks = tmp_path / "bench-tasks"
    ensure_demo_task(tasks, TASK, [chatml(q, a) for q, a in pairs])
    docs = [json.loads(line) for line in (tasks / f"{TASK}.jsonl").read_text().splitlines()]
    with (tmp_path / "shuffled.jsonl").open("w") as f:
        for d in docs:
            wrong = d["choices"][(d["gold"] + 1) % len(d["choices"])]  # the answer's own words, another order
            turns = [{"role": "user", "content": d["question"]}, {"role": "assistant", "content": wrong}]
            f.write(json.dumps({"messages": turns}) + "\n")

    data = yaml.safe_load(DEMO.read_text())
    base = tmp_path / "base"
    data["model"].update({"weights": str(base), "config": str(DEMO.parent / data["model"]["config"])})
    data["model"].update(
        {"build_demo_weights": False, "tokenizer": {"path": str(tmp_path / "tok"), "train_vocab": 512}}
    )
    data["dataset"] = {"path": str(tmp_path / "shuffled.jsonl")}
    data["sharding"].update({"output": str(tmp_path / "shards"), "num_shards": 1, "heldout": 0.0})
    data["cluster"]["gpus_per_node"] = 1
    data["parallel"]["dp_shard"] = 1
    data["train"].update({"steps": 14, "warmup_steps": 1, "seq_len": 64, "checkpoint_every": 0})
    data["validate"] = {"min_loss_drop": 0.05, "benchmarks": data["validate"]["benchmarks"]}
    data["validate"]["benchmarks"].update({"include_path": str(tasks), "completions": 0, "batch_size": 32})
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))

    ensure_demo_weights(base, data["model"]["config"])  # the demo's random Qwen2, then taught the true answers
    prepare_chat_tokenizer(load_spec(tmp_path / "spec.yaml"))
    texts = [chatml(d["question"], d["choices"][d["gold"]]) for d in docs]
    train_on(base, texts, base, steps=30, lr=1e-2, tokenizer=tmp_path / "tok")
    return data


@pytest.mark.slow
def test_a_run_trained_on_shuffled_answers_fails_its_max_drop_gate(prefect_backend, tmp_path):
    from nightloom.benchmarks.stage import FAILED_MARK
    from nightloom.ledger import Ledger

    data = _planted(tmp_path)
    rc, out = _cli(["run", str(tmp_path / "spec.yaml")])
    assert rc == 1, out[-5000:]

    with Ledger(data["ledger"]["url"]) as ledger:
        (row,) = ledger.list_runs()
    assert row.status == "failed" and not row.verified
    failed = [v for v in row.verdicts if not v.passed]
    assert [v.name for v in failed] == [GATE], row.verdicts  # the planted drop, and nothing else
    acc = {f.name: f for f in row.figures}[f"bench/{TASK}/acc"]
    assert acc.base >= 0.9 and acc.base - acc.value > 0.3, acc  # the base knew the answers; the run unlearned them
    drop = f"{TASK} acc: base {acc.base:.4f} -> tuned {acc.value:.4f}, drop {acc.base - acc.value:.4f} > 0.1"
    assert failed[0].reason == drop and failed[0].measured == pytest.approx(acc.value - acc.base)
    assert drop in out  # the terminal says it too

    fr = _flow_run(row.run_id)
    assert fr.state.is_failed() and GATE in (fr.state.message or ""), fr.state
    export = Path(data["storage"]["root"]) / row.run_id / "export"
    assert (export / "config.json").is_file()  # kept
    assert [v["name"] for v in json.loads((export / FAILED_MARK).read_text())["failed"]] == [GATE]  # and marked
    [cached] = (Path(data["storage"]["root"]) / ".benchmarks").glob("base-*.json")  # the next night skips the base
    assert {(s["task"], s["metric"]): s["value"] for s in json.loads(cached.read_text())["scores"]}[(TASK, "acc")] == (
        acc.base
    )
