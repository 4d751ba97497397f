"""A Gemma 3 checkpoint no one here trained (a random one transformers writes: tied, (1 + w) norm weights not all 0,
a sliding window of 32 tokens on three layers of four, shorter than the training windows (128) and the scored
prefixes (256)) through `nightloom run` (FSDP2 on 2 processes, 2 steps at a negligible learning rate, a BPE tokenizer
folder) and `nightloom eval RUN --data eval.jsonl --seq-len 256 --json`: the mean NLL equals transformers'
Gemma3ForCausalLM on the original checkpoint (the same tokenizer through AutoTokenizer) within 1e-4, and so does the
run's export."""

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
GEMMA3 = {
    "vocab_size": 320,  # >= the BPE's 300 ids
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "query_pre_attn_scalar": 32,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
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


def test_gemma3_run_then_eval_equals_transformers(prefect_backend, tmp_path):
    from nightloom.hf.random_model import build_random_model
    from nightloom.spec import DatasetSpec, TokenizerSpec
    from nightloom.tokenizer import ensure_trained

    lines = (ROOT / "datasets" / "sample" / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines[:400]) + "\n", encoding="utf-8")
    longer = [t for t in (json.loads(line)["text"] for line in lines[400:]) if len(t) > 1500]  # past SEQ ids
    docs = longer[:6] + [json.loads(line)["text"] for line in lines[400:406]] + ["x", "Gemma 3 sliding window"]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tokenizer = tmp_path / "tokenizer"
    assert ensure_trained(TokenizerSpec(path=str(tokenizer), train_vocab=300), DatasetSpec(path=str(corpus)))
    weights = build_random_model(
        tmp_path / "gemma3", "gemma3_text", seed=11, max_shard_size="200KB", norm_std=0.3, **GEMMA3
    )

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
    print(f"gemma3 run: nightloom eval {ours['loss']:.8f}, transformers {ref:.8f} ({tokens} tokens)")
    assert ours["step"] == 2 and ours["tokens"] == tokens and tokens > 6 * (SEQ - 1)
    assert abs(ours["loss"] - ref) < TOL, (ours["loss"], ref)
    # the run's export: transformers reloads it (a Gemma 3 with its windows and RoPE bases) and scores it the same
    export = Path(summary["export_dir"])
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["sliding_window"] == 32
    exported, _ = _transformers_nll(export, export, docs)
    print(f"gemma3 export: transformers {exported:.8f}")
    assert abs(exported - ref) < TOL, (exported, ref)
