"""A Qwen3 checkpoint no one here trained (a random one transformers writes, q/k norm weights not all 1) through
`nightloom run` (FSDP2 on 2 processes, 2 steps at a negligible learning rate, a BPE tokenizer folder) and
`nightloom eval RUN --data eval.jsonl --seq-len 256 --json`: the mean NLL equals transformers' Qwen3ForCausalLM on
the original checkpoint (the same tokenizer through AutoTokenizer) within 1e-4, and so does the run's export."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

ROOT = Path(__file__).resolve().parents[2]
SEQ = 256
TOL = 1e-4
QWEN3 = {
    "vocab_size": 320,  # >= the BPE's 300 ids
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
}


def _transformers_nll(model_dir: Path, tokenizer_dir: Path, docs: list[str]) -> tuple[float, int]:
    """Mean NLL per predicted token of each document's first SEQ ids (AutoTokenizer's, no EOS), and their count."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total, count = 0.0, 0
    for d in docs:
        ids = tok(d)["input_ids"][:SEQ]
        if len(ids) < 2:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        total += float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").double())
        count += len(ids) - 1
    return total / count, count


def _cli(args: list[str]) -> tuple[int, str]:
    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(args)
    return rc, buf.getvalue()


def test_qwen3_run_then_eval_equals_transformers(prefect_backend, tmp_path):
    from nightloom.hf.random_model import build_random_model
    from nightloom.spec import DatasetSpec, TokenizerSpec
    from nightloom.tokenizer import ensure_trained

    lines = (ROOT / "datasets" / "sample" / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines[:400]) + "\n", encoding="utf-8")
    longer = [t for t in (json.loads(line)["text"] for line in lines[400:]) if len(t) > 1500]  # past SEQ ids
    docs = longer[:6] + [json.loads(line)["text"] for line in lines[400:406]] + ["x", "Qwen3 q/k norm"]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tokenizer = tmp_path / "tokenizer"
    assert ensure_trained(TokenizerSpec(path=str(tokenizer), train_vocab=300), DatasetSpec(path=str(corpus)))
    weights = build_random_model(tmp_path / "qwen3", "qwen3", seed=11, max_shard_size="200KB", norm_std=0.3, **QWEN3)

    data = yaml.safe_load((ROOT / "deployments" / "continue-pretrain-demo.yaml").read_text())
    data["model"] = {"weights": str(weights), "tokenizer": str(tokenizer)}
    data["dataset"] = {"path": str(corpus), "text_field": "text"}
    data["sharding"] = {"num_shards": 2, "output": str(tmp_path / "shards")}
    data["storage"]["root"] = str(tmp_path / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp_path / 'ledger.db'}"
    data["train"].update({"steps": 2, "seq_len": 128, "lr": 1e-9, "warmup_steps": 0, "checkpoint_every": 0})
    data["validate"] = {"min_loss_drop": 0.0}  # a negligible learning rate: the loss is not meant to fall
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))

    rc, out = _cli(["run", str(spec), "--json"])
    assert rc == 0, out[-3000:]
    summary = json.loads(out[out.index("{") :])
    assert summary["status"] == "completed" and summary["steps"] == 2, summary
    run_dir = Path(summary["run_dir"])

    rc, out = _cli(["eval", str(run_dir), "--data", str(tmp_path / "eval.jsonl"), "--seq-len", str(SEQ), "--json"])
    assert rc == 0, out
    ours = json.loads(out)
    ref, tokens = _transformers_nll(weights, tokenizer, docs)
    print(f"qwen3 run: nightloom eval {ours['loss']:.8f}, transformers {ref:.8f} ({tokens} tokens)")
    assert ours["step"] == 2 and ours["tokens"] == tokens and tokens > 6 * (SEQ - 1)
    assert abs(ours["loss"] - ref) < TOL, (ours["loss"], ref)
    # the run's export: transformers reloads it (a Qwen3 with q/k norms) and scores it the same
    export = Path(summary["export_dir"])
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    exported, _ = _transformers_nll(export, export, docs)
    assert abs(exported - ref) < TOL, (exported, ref)
