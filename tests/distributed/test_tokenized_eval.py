"""Training on real BPE ids with a held-out split: eval loss the same under 1 process, TP2 and PP2; `nightloom eval`
equals a plain PyTorch computation on the same checkpoint.

The corpus is tokenized by a byte-level BPE trained with `tokenizers` (nightloom.tokenizer.ensure_trained),
sharded with `sharding.heldout`; the tiny model gets the tokenizer's vocabulary (> 256, so byte ids cannot pass).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench._support import WORDS
from tests.support.harness import launch

EXTRA = ["数据", "模型", "🌙", "naïve", "café", "Straße"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
    from nightloom.tokenizer import ensure_trained, load_tokenizer

    root = tmp_path_factory.mktemp("tok-eval")
    rng = random.Random(7)
    vocab = WORDS + EXTRA
    docs = [" ".join(rng.choice(vocab) for _ in range(rng.randint(20, 60))) for _ in range(240)]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    ds = DatasetSpec(path=str(corpus))
    tspec = TokenizerSpec(path=str(root / "tokenizer"), train_vocab=300)
    assert ensure_trained(tspec, ds)
    first = (root / "tokenizer" / "tokenizer.json").read_bytes()
    tok = load_tokenizer(tspec)
    manifest = shard_dataset(
        ds, ShardingSpec(output=str(root / "shards"), num_shards=2, tolerance=0.5, heldout=0.1), tokenizer=tspec
    )
    return root, tspec, tok, manifest, docs, first


def test_bpe_training_is_deterministic(data, tmp_path):
    from nightloom.spec import DatasetSpec, TokenizerSpec
    from nightloom.tokenizer import ensure_trained

    root, _, tok, _, _, first = data
    again = TokenizerSpec(path=str(tmp_path / "tok2"), train_vocab=300)
    assert ensure_trained(again, DatasetSpec(path=str(root / "corpus.jsonl")))
    assert (tmp_path / "tok2" / "tokenizer.json").read_bytes() == first
    assert not ensure_trained(again, DatasetSpec(path=str(root / "corpus.jsonl")))  # kept, not retrained
    assert 256 < tok.vocab_size <= 300


def test_heldout_split_is_disjoint_and_counted_with_the_tokenizer(data):
    import pyarrow.parquet as pq

    root, _, tok, m, docs, _ = data
    assert m.heldout is not None and m.heldout.rows > 0
    assert m.tokenizer == tok.fingerprint() != "bytes"
    held = pq.read_table(root / "shards" / m.heldout.path).column("text").to_pylist()
    train = [t for s in m.shards for t in pq.read_table(root / "shards" / s.path).column("text").to_pylist()]
    assert not set(held) & set(train)
    assert len(set(held) | set(train)) == len(set(docs))
    assert m.heldout.tokens == sum(len(tok.encode(t)) for t in held)
    assert m.tokens == sum(len(tok.encode(t)) for t in train)


def _job(run_dir: Path, data, **plan) -> Path:
    from nightloom.catalog import get_model
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    root, tspec, tok, *_ = data
    run_dir.mkdir(parents=True, exist_ok=True)
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=(get_model("tiny").with_(vocab=tok.vocab_size)),
        plan=ParallelPlan(**plan),
        train=TrainSpec(steps=3, seq_len=32, global_batch=4, lr=3e-3, warmup_steps=1, collective_timeout_s=60),
        manifest=str(root / "shards"),
        peak_flops=50e9,
        peak_source="test constant",
        tokenizer=tspec,
        eval_every=2,
        eval_windows=8,
    )
    p = run_dir / "job.json"
    p.write_text(job.model_dump_json(indent=2), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    job = _job(tmp_path_factory.mktemp("run") / "single", data, micro_batch=1, grad_accum=4)
    return job, launch(1, job, timeout=240)


def test_eval_is_logged_at_step_1_every_k_and_at_the_end(single, data):
    _, out = single
    evals = {m.step: (m.eval_loss, m.eval_tokens, m.eval_ppl) for m in out.metrics if m.eval_loss is not None}
    assert sorted(evals) == [1, 2, 3]
    for loss, tokens, ppl in evals.values():
        assert tokens == 8 * 32 and abs(ppl - torch.tensor(loss).exp().item()) < 1e-6 * ppl
        assert 0 < loss < 1.5 * torch.tensor(float(data[2].vocab_size)).log().item()


@pytest.mark.parametrize(
    "plan",
    [{"tp": 2, "sp": True, "micro_batch": 1, "grad_accum": 4}, {"pp": 2, "micro_batch": 1, "grad_accum": 4}],
    ids=["tp2_sp", "pp2"],
)
def test_eval_loss_is_layout_free(single, data, tmp_path, plan):
    _, ref = single
    job = _job(tmp_path / "run", data, **plan)
    out = launch(2, job, timeout=240)
    a = {m.step: m.eval_loss for m in ref.metrics if m.eval_loss is not None}
    b = {m.step: m.eval_loss for m in out.metrics if m.eval_loss is not None}
    assert sorted(a) == sorted(b)
    assert abs(a[1] - b[1]) < 1e-5, (a, b)  # step 1: before the layouts' float sums diverge


def test_nightloom_eval_equals_plain_pytorch(single, data, tmp_path):
    """`nightloom eval` on held-out-style documents == cross entropy computed here from the same checkpoint."""
    from flows.cli import main
    from nightloom.train.evaluate import load_model

    job, _ = single
    root, _, tok, _, docs, _ = data
    eval_docs = docs[:5] + ["数据 🌙 café", "x"]
    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps({"text": d}) + "\n" for d in eval_docs), encoding="utf-8")
    model, _, step, _ = load_model(job.parent, 16)
    total, count = 0.0, 0
    for d in eval_docs:
        ids = tok.encode(d)[:16]  # no EOS, first seq-len ids
        if len(ids) < 2:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]]))[0]
        total += F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["eval", str(job.parent), "--data", str(f), "--seq-len", "16", "--json"]) == 0
    got = json.loads(buf.getvalue())
    assert step == 3 and got["step"] == 3
    assert got["tokens"] == count
    assert abs(got["loss"] - total / count) < 1e-5
    assert abs(got["ppl"] - torch.tensor(total / count).exp().item()) < 1e-4


def test_nightloom_eval_equals_transformers(single, data, tmp_path):
    """The same checkpoint exported to Hugging Face (nightloom.hf.export) and scored by transformers'
    LlamaForCausalLM with AutoTokenizer's ids: mean NLL per predicted token within 1e-5 of `nightloom eval`."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from nightloom.hf.export import export_checkpoint
    from nightloom.train import checkpoint
    from nightloom.train.evaluate import evaluate_run, run_job

    job_path, _ = single
    root, tspec, _, _, docs, _ = data
    job = run_job(job_path.parent)
    ckpt, _ = checkpoint.latest(job.checkpoint_dir)
    out = export_checkpoint(ckpt, job.model, tmp_path / "hf", dtype="fp32", tokenizer=tspec.path)
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    model = LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    eval_docs = docs[5:12] + ["数据 🌙 café naïve", "x"]
    total, count = 0.0, 0
    for d in eval_docs:
        ids = hf_tok(d)["input_ids"][:24]
        if len(ids) < 2:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        total += F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps({"text": d}) + "\n" for d in eval_docs), encoding="utf-8")
    ours = evaluate_run(job_path.parent, f, 24)
    assert ours.tokens == count
    assert abs(ours.loss - total / count) < 1e-5, (ours.loss, total / count)
