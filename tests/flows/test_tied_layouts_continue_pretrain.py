"""A tied Qwen3 checkpoint no one here trained (a random one transformers writes, q/k norm weights not all 1, one
embedding matrix for input and output) through `nightloom run` under an explicit TP2 and an explicit PP2 layout (2
steps at a negligible learning rate), then `nightloom eval RUN --data eval.jsonl --seq-len 256 --json`: the mean
NLL equals transformers' Qwen3ForCausalLM on the original checkpoint within 1e-4, and so does the run's export,
which transformers reloads as a tied model. The tokenizer, corpus, checkpoint, shards and the reference NLL are
built once for both layouts (issue 38, "Must show")."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.support.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SEQ = 256
TOL = 1e-4
QWEN3_TIED = {
    "vocab_size": 320,  # >= the BPE's 300 ids, even (vocab-parallel under TP2)
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 4,  # two layers per stage under PP2
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "rope_theta": 1e6,
    "tie_word_embeddings": True,
}
LAYOUTS = {
    "tp2": {"tp": 2, "dp_shard": 1, "micro_batch": 2},
    "pp2": {"pp": 2, "dp_shard": 1, "micro_batch": 2, "schedule": "1f1b"},
}


@dataclass(frozen=True)
class Setup:
    """What both layouts share: the files a run reads and transformers' NLL of the original checkpoint."""

    root: Path
    corpus: Path
    eval_data: Path
    tokenizer: Path
    weights: Path
    docs: list[str]
    ref_nll: float
    ref_tokens: int
    #: loss and grad_norm of steps 1 and 2 of each layout run so far: the same batches, so the layouts must agree
    steps: dict[str, list[float]] = field(default_factory=dict)


def _transformers_nll(model_dir: Path, tokenizer_dir: Path, docs: list[str]) -> tuple[float, int]:
    """Mean NLL per predicted token of each document's first SEQ ids (AutoTokenizer's, no EOS), and their count."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
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


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    from safetensors import safe_open

    from nightloom.hf.random_model import build_random_model
    from nightloom.spec import DatasetSpec, TokenizerSpec
    from nightloom.tokenizer import ensure_trained

    root = tmp_path_factory.mktemp("tied-layouts")
    lines = (ROOT / "datasets" / "sample" / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(lines[:400]) + "\n", encoding="utf-8")
    longer = [t for t in (json.loads(line)["text"] for line in lines[400:]) if len(t) > 1500]  # past SEQ ids
    docs = longer[:6] + [json.loads(line)["text"] for line in lines[400:406]] + ["x", "tied Qwen3 head"]
    eval_data = root / "eval.jsonl"
    eval_data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tokenizer = root / "tokenizer"
    assert ensure_trained(TokenizerSpec(path=str(tokenizer), train_vocab=300), DatasetSpec(path=str(corpus)))
    weights = build_random_model(
        root / "qwen3-tied", "qwen3", seed=23, max_shard_size="200KB", norm_std=0.3, **QWEN3_TIED
    )
    names = set()
    for f in weights.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names |= set(st.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # the checkpoint is tied
    ref, tokens = _transformers_nll(weights, tokenizer, docs)
    return Setup(root, corpus, eval_data, tokenizer, weights, docs, ref, tokens)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tied_qwen3_run_then_eval_equals_transformers(prefect_backend, setup: Setup, layout: str):
    s = setup
    data = yaml.safe_load((ROOT / "deployments" / "continue-pretrain-demo.yaml").read_text())
    data["model"] = {"weights": str(s.weights), "tokenizer": str(s.tokenizer)}
    data["dataset"] = {"path": str(s.corpus), "text_field": "text"}
    data["sharding"] = {"num_shards": 2, "output": str(s.root / "shards")}  # the second layout reuses the shards
    data["cluster"]["master_port"] = free_port()
    data["parallel"] = LAYOUTS[layout]
    data["storage"]["root"] = str(s.root / f"runs-{layout}")
    data["ledger"]["url"] = f"sqlite:///{s.root / f'ledger-{layout}.db'}"
    data["train"].update({"steps": 2, "seq_len": 128, "lr": 1e-9, "warmup_steps": 0, "checkpoint_every": 0})
    data["validate"] = {"min_loss_drop": 0.0}  # a negligible learning rate: the loss is not meant to fall
    spec = s.root / f"spec-{layout}.yaml"
    spec.write_text(yaml.safe_dump(data))

    rc, out = _cli(["run", str(spec), "--json"])
    assert rc == 0, out[-3000:]
    summary = json.loads(out[out.index("{") :])
    assert summary["status"] == "completed" and summary["steps"] == 2, summary
    run_dir = Path(summary["run_dir"])
    plan = json.loads(sorted(run_dir.glob("job-attempt*.json"))[-1].read_text())["plan"]
    assert (plan["tp"], plan["pp"]) == (LAYOUTS[layout].get("tp", 1), LAYOUTS[layout].get("pp", 1)), plan
    # the other layout's steps (when it ran first): same loss and gradient norm, so the tied matrix's gradient is
    # the whole model's under both (PP sums the two stages' copies; the norm counts the matrix once)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    s.steps[layout] = [x for m in metrics if "grad_norm" in m for x in (m["loss"], m["grad_norm"])]
    for other, seen in s.steps.items():
        assert len(seen) == 4 and seen == pytest.approx(s.steps[layout], rel=1e-5), (layout, other, s.steps)

    rc, out = _cli(["eval", str(run_dir), "--data", str(s.eval_data), "--seq-len", str(SEQ), "--json"])
    assert rc == 0, out
    ours = json.loads(out)
    print(
        f"tied qwen3 {layout}: nightloom eval {ours['loss']:.8f}, transformers {s.ref_nll:.8f} ({s.ref_tokens} tokens)"
    )
    assert ours["step"] == 2 and ours["tokens"] == s.ref_tokens and s.ref_tokens > 6 * (SEQ - 1)
    assert abs(ours["loss"] - s.ref_nll) < TOL, (ours["loss"], s.ref_nll)
    # the run's export: one embedding matrix (tied in config.json, no lm_head tensor), scored the same
    export = Path(summary["export_dir"])
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"] is True, config
    assert "lm_head.weight" not in json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    exported, _ = _transformers_nll(export, export, s.docs)
    print(f"tied qwen3 {layout}: export {exported:.8f}")
    assert abs(exported - s.ref_nll) < TOL, (exported, s.ref_nll)
