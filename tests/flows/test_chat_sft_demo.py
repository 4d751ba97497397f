"""The README's chat fine-tuning demo (deployments/chat-sft-demo.yaml), run as shipped but with its build folders
under tmp: the chats are built from the standard library's docstrings, a ChatML BPE is trained on them, a small
Qwen2 is built from deployments/chat-sft-demo-model.json, LoRA trains packed conversations under FSDP2 on 2
ranks, every gate passes, and peft.AutoPeftModelForCausalLM loads the exported adapter alone (its base named in
adapter_config.json) with the merged export's logits; the export chats (its template) and is readable by others."""

from __future__ import annotations

import contextlib
import io
import json
import os
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
    import transformers

    data = yaml.safe_load(DEMO.read_text())
    data["model"]["weights"] = str(tmp_path / "models" / "qwen2")
    data["model"]["config"] = str(DEMO.parent / data["model"]["config"])
    data["model"]["tokenizer"]["path"] = str(tmp_path / "tokenizer")
    data["dataset"]["path"] = str(tmp_path / "chats.jsonl")
    data["sharding"]["output"] = str(tmp_path / "shards")
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    data["validate"]["benchmarks"]["include_path"] = str(tmp_path / "bench-tasks")
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

    _benchmarks_recorded(summary, tmp_path)
    export = Path(summary["export_dir"])
    assert summary["adapter_dir"] == str(export / "adapter")  # the summary names it (run-summary, notebook too)
    _adapter_loads_alone_with_the_merged_logits(export, tmp_path / "models" / "qwen2")
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in export.rglob("*.safetensors")}
    assert set(modes.values()) == {oct(0o666 & ~mask)}, modes  # as the run's other files, not 0600
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert "<|im_start|>assistant" in transformers.AutoTokenizer.from_pretrained(str(export)).apply_chat_template(
        chat, tokenize=False
    )


def _benchmarks_recorded(summary: dict, tmp_path: Path) -> None:
    """validate.benchmarks: the demo task was built from the held-out chats, lm-eval scored base and tuned, the
    ledger row holds both per metric (schema 7 figures), the summary and the run folder show them, and the
    base's scores are cached for the next night."""
    from nightloom.ledger import Ledger

    assert (tmp_path / "bench-tasks" / "chat_sft_demo_mc.yaml").is_file()
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        figs = {f.name: f for f in ledger.get(summary["run_id"]).figures}
    assert set(figs) == {"bench/chat_sft_demo_mc/acc", "bench/chat_sft_demo_mc/acc_norm"}, figs
    for f in figs.values():
        assert 0 <= f.value <= 1 and 0 <= f.base <= 1 and f.stderr > 0, f
    assert [f["name"] for f in summary["figures"]] == sorted(figs)
    gate = next(v for v in summary["verdicts"] if v["name"] == "bench:chat_sft_demo_mc/acc:max_drop")
    assert (
        gate["passed"]
        and gate["measured"] == figs["bench/chat_sft_demo_mc/acc"].value - figs["bench/chat_sft_demo_mc/acc"].base
    )
    assert "benchmarks" in [s["stage"] for s in summary["stages"]]
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "completions.md").read_text().count("\n| What does") == 3
    assert len(list((tmp_path / "runs" / ".benchmarks").glob("base-*.json"))) == 1


def _adapter_loads_alone_with_the_merged_logits(export: Path, weights: Path) -> None:
    """peft.AutoPeftModelForCausalLM finds the base from adapter_config.json alone (the demo's weights folder) and
    gives the merged export's logits; by hand with PeftModel, the same."""
    import peft
    import torch
    import transformers

    adapter = export / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(weights)
    alone = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter)).eval()
    assert alone.peft_config["default"].r == 8
    by_hand = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(weights)), str(adapter)
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    assert merged.config.model_type == "qwen2"
    ids = torch.randint(3, merged.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, h, m = (x(ids).logits.float() for x in (alone, by_hand.eval(), merged))
    print(
        f"AutoPeft vs merged export: max |logit diff| {(a - m).abs().max().item():.2e} (logits up to {m.abs().max():.1f})"
    )
    torch.testing.assert_close(a, h, rtol=0, atol=0)
    torch.testing.assert_close(a, m, rtol=0, atol=1e-3 * max(1.0, m.abs().max().item()))
