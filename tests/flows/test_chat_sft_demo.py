"""The README's chat fine-tuning demo (deployments/chat-sft-demo.yaml), run as shipped but with its build folders
under tmp: the chats are built from the standard library's docstrings, a ChatML BPE is trained on them, a small
Qwen2 is built from deployments/chat-sft-demo-model.json, LoRA trains packed conversations under FSDP2 on 2
ranks, every gate passes, and PEFT loads the exported adapter onto the base."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "deployments" / "chat-sft-demo.yaml"


def _cli(args: list[str]) -> tuple[int, str]:
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(args)
    return rc, buf.getvalue()


@pytest.mark.slow
def test_chat_sft_demo_runs_as_shipped(prefect_backend, tmp_path):
    import peft
    import transformers

    data = yaml.safe_load(DEMO.read_text())
    data["model"]["weights"] = str(tmp_path / "models" / "qwen2")
    data["model"]["config"] = str(DEMO.parent / data["model"]["config"])
    data["model"]["tokenizer"]["path"] = str(tmp_path / "tokenizer")
    data["dataset"]["path"] = str(tmp_path / "chats.jsonl")
    data["sharding"]["output"] = str(tmp_path / "shards")
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    spec = tmp_path / "chat-sft-demo.yaml"
    spec.write_text(yaml.safe_dump(data))

    rc, out = _cli(["run", str(spec), "--json"])
    assert rc == 0, out[-5000:]
    summary = json.loads(out[out.index("{\n") :])
    assert summary["status"] == "completed" and summary["steps"] == data["train"]["steps"], summary
    result = json.loads((Path(summary["run_dir"]) / "result.json").read_text())
    assert result["conversations_per_row"] > 1.5 and result["pack_fill"] > 0.8, result  # packed
    first = json.loads((tmp_path / "chats.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in first["messages"]][:2] == ["system", "user"]  # OpenAI-style chats, built here
    tok_config = json.loads((tmp_path / "tokenizer" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"] and tok_config["eos_token"] == "<|im_end|>"
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["chat"]["label_tokens"] > 0 and manifest["heldout"] is not None

    export = Path(summary["export_dir"])
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "models" / "qwen2"))
    adapted = peft.PeftModel.from_pretrained(base, str(export / "adapter"))
    assert adapted.peft_config["default"].r == 8
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(export))
    assert merged.config.model_type == "qwen2"
