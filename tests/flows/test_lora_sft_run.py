"""Chat fine-tuning end to end through `nightloom run`: a tiny random Qwen2 whose ChatML template has no generation
markers, chats with system, user and assistant turns (some multi-turn), 16 steps of

- LoRA SFT under FSDP2 on 2 ranks: PEFT loads export/adapter/ onto the base model and transformers loads the
  merged export/; both score held-out chats (assistant tokens only, prefix rule) as `nightloom eval RUN --data
  chats.jsonl --seq-len 512 --json` does, over the same tokens, and better than the base model;
- full SFT under TP2: transformers' score of the export equals `nightloom eval`'s and beats the base.

And a record with an unknown role is reported as file:line."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from tests.support.chat import (
    QWEN2,
    build_chat_tokenizer,
    chat_messages,
    prefix_rule_labels,
    transformers_sft_nll,
    write_chats,
)

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {
    "lora_fsdp2": ({"dp_shard": 2, "micro_batch": 2}, {"rank": 8, "alpha": 16, "targets": "all-linear"}),
    "full_tp2": ({"tp": 2, "micro_batch": 2}, None),
}


def _cli(args: list[str]) -> tuple[int, str]:
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(args)
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    from nightloom.hf.random_model import build_random_model

    root = tmp_path_factory.mktemp("chat-sft")
    tokenizer = build_chat_tokenizer(root / "tok")
    weights = build_random_model(root / "qwen2", "qwen2", seed=7, **QWEN2)
    write_chats(root / "train.jsonl", chat_messages(48, seed=21))
    held_out = chat_messages(10, seed=22)
    return root, tokenizer, weights, write_chats(root / "chats.jsonl", held_out), held_out


def _spec(root: Path, tmp: Path, tokenizer: Path, weights: Path, parallel: dict, lora: dict | None) -> dict:
    data = yaml.safe_load((ROOT / "deployments" / "continue-pretrain-demo.yaml").read_text())
    data["name"] = "chat-sft"
    data["model"] = {"weights": str(weights), "tokenizer": str(tokenizer)}
    data["dataset"] = {"path": str(root / "train.jsonl")}
    data["sharding"] = {"num_shards": 2, "output": str(tmp / "shards"), "tolerance": 0.9}
    data["storage"]["root"] = str(tmp / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp / 'ledger.db'}"
    data["parallel"] = parallel
    train = {"task": "sft", "steps": 16, "seq_len": 96, "lr": 3e-3, "warmup_steps": 0, "checkpoint_every": 0}
    data["train"].update(train | ({"lora": lora, "lr": 2e-2} if lora else {}))
    data["validate"] = {"min_loss_drop": 0.0}
    return data


def _peft_nll(base: Path, adapter: Path, tokenizer: Path, conversations) -> tuple[float, int]:
    """transformers' base model with PEFT's adapter loaded on it: the mean assistant-token NLL (prefix rule)."""
    import peft
    import torch
    import torch.nn.functional as F
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    total, count = 0.0, 0
    for messages in conversations:
        ids, labels = prefix_rule_labels(tok, messages)
        mask = torch.tensor(labels[1:], dtype=torch.bool)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        total += float(F.cross_entropy(logits[mask], torch.tensor(ids[1:])[mask], reduction="sum").double())
        count += int(mask.sum())
    return total / count, count


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chat_sft_exports_score_as_nightloom_eval(prefect_backend, chats, tmp_path, name):
    root, tokenizer, weights, data, held_out = chats
    parallel, lora = LAYOUTS[name]
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(_spec(root, tmp_path, tokenizer, weights, parallel, lora)))
    rc, out = _cli(["run", str(spec), "--json"])
    assert rc == 0, out[-4000:]
    summary = json.loads(out[out.index("{\n") :])
    assert summary["status"] == "completed" and summary["steps"] == 16, summary

    rc, out = _cli(["eval", summary["run_dir"], "--data", str(data), "--seq-len", "512", "--json"])
    assert rc == 0, out
    ours = json.loads(out)
    export = Path(summary["export_dir"])
    merged, tokens = transformers_sft_nll(export, export, held_out)  # the export's own tokenizer and template
    base, _ = transformers_sft_nll(weights, tokenizer, held_out)
    print(f"{name}: nightloom eval {ours['loss']:.6f}, merged {merged:.6f}, base {base:.6f} over {tokens} tokens")
    assert ours["task"] == "sft" and ours["tokens"] == tokens and ours["dropped"] == 0
    assert abs(ours["loss"] - merged) < 1e-4, (ours, merged)
    assert merged < base, (merged, base)
    if lora is None:
        assert not (export / "adapter").exists()
        return
    config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    adapted, count = _peft_nll(weights, export / "adapter", tokenizer, held_out)
    print(f"{name}: PEFT base + adapter {adapted:.6f} over {count} tokens")
    assert count == tokens and abs(adapted - ours["loss"]) < 1e-4, (adapted, ours)


def test_an_unknown_role_is_reported_as_file_and_line(prefect_backend, chats, tmp_path):
    root, tokenizer, weights, _, _ = chats
    bad = tmp_path / "bad.jsonl"
    lines = (root / "train.jsonl").read_text().splitlines()
    record = json.loads(lines[2])
    record["messages"][-1]["role"] = "wizard"
    lines[2] = json.dumps(record)
    bad.write_text("\n".join(lines) + "\n")
    data = _spec(root, tmp_path, tokenizer, weights, *LAYOUTS["lora_fsdp2"])
    data["dataset"]["path"] = str(bad)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    rc, out = _cli(["run", str(spec)])
    assert rc != 0 and f"{bad}:3" in out and "wizard" in out, out[-3000:]
