"""`nightloom run` of a train.task sft spec end to end: chat records in three styles (OpenAI messages, ShareGPT,
Alpaca) with a held-out split, a tiny random Qwen2 and a BPE tokenizer whose ChatML template has no generation
markers, FSDP2 on 2 processes. Then `nightloom eval RUN --data chats.jsonl --json` counts the same assistant
tokens as transformers' prefix rule and scores the run's export (tokenizer and template included) as
transformers does; `nightloom validate` refuses the same spec with a tokenizer that has no chat template."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import yaml

from tests.support.chat import QWEN2, as_record, build_chat_tokenizer, chat_messages, transformers_sft_nll, write_chats

ROOT = Path(__file__).resolve().parents[2]


def _cli(args: list[str]) -> tuple[int, str]:
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(args)
    return rc, buf.getvalue()


def _spec(tmp_path: Path, tokenizer: Path, weights: Path, corpus: Path) -> dict:
    data = yaml.safe_load((ROOT / "deployments" / "continue-pretrain-demo.yaml").read_text())
    data["name"] = "sft-run"
    data["model"] = {"weights": str(weights), "tokenizer": str(tokenizer)}
    data["dataset"] = {"path": str(corpus)}
    data["sharding"] = {"num_shards": 2, "output": str(tmp_path / "shards"), "tolerance": 0.5, "heldout": 8}
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    data["train"].update(
        {"task": "sft", "steps": 4, "seq_len": 96, "lr": 3e-3, "warmup_steps": 0, "checkpoint_every": 0}
    )
    data["validate"] = {"min_loss_drop": 0.0, "eval_every": 2, "eval_windows": 8}
    return data


def test_sft_run_then_eval_counts_the_assistant_tokens_of_transformers(prefect_backend, tmp_path):
    from nightloom.hf.random_model import build_random_model

    tokenizer = build_chat_tokenizer(tmp_path / "tok")
    weights = build_random_model(tmp_path / "qwen2", "qwen2", seed=7, **QWEN2)
    train = chat_messages(64, seed=11, long_every=9)
    lines = []
    for i, c in enumerate(train):
        one_turn = sum(m["role"] == "assistant" for m in c) == 1
        style = ("messages", "sharegpt", "alpaca")[i % 3] if one_turn else ("messages", "sharegpt")[i % 2]
        lines.append(json.dumps(as_record(c, style)))
    corpus = tmp_path / "chats-train.jsonl"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(_spec(tmp_path, tokenizer, weights, corpus)))

    rc, out = _cli(["run", str(spec), "--json"])
    assert rc == 0, out[-4000:]
    summary = json.loads(out[out.index("{\n") :])
    assert summary["status"] == "completed" and summary["steps"] == 4, summary
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["chat"]["cut"] > 0 and manifest["chat"]["label_tokens"] > 0, manifest["chat"]
    metrics = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    held = manifest["heldout"]["token_files"]["label_tokens"]
    evals = {m["step"]: m["eval_tokens"] for m in metrics if m.get("eval_loss") is not None}
    assert evals == {1: held, 2: held, 4: held}  # after step 1, every eval_every and at the end

    held_out = chat_messages(10, seed=12)  # multi-turn, with system turns; none longer than --seq-len + 1
    data = write_chats(tmp_path / "chats.jsonl", held_out)
    rc, out = _cli(["eval", summary["run_dir"], "--data", str(data), "--seq-len", "512", "--json"])
    assert rc == 0, out
    ours = json.loads(out)
    export = Path(summary["export_dir"])
    ref, tokens = transformers_sft_nll(export, export, held_out)  # the export's own tokenizer and template
    print(f"sft run: nightloom eval {ours['loss']:.8f}, transformers {ref:.8f} ({tokens} assistant tokens)")
    assert ours["task"] == "sft" and ours["step"] == 4 and ours["documents"] == 10 and ours["dropped"] == 0
    assert ours["tokens"] == tokens and abs(ours["loss"] - ref) < 1e-4, (ours, ref)

    bare = build_chat_tokenizer(tmp_path / "bare", template=None)
    spec.write_text(yaml.safe_dump(_spec(tmp_path, bare, weights, corpus)))
    rc, out = _cli(["validate", str(spec)])
    assert rc != 0 and f"model.chat_template: tokenizer {bare} has no chat template" in out, out
