"""train.task dpo in the native trainer, one process: with full fine-tuning the reference's log-probs are computed
once from the initial weights, equal transformers' own summed completion log-probs of the same pairs, are stored
beside the shards and reused by a resumed run (and refused missing on resume); step 1's loss is ln 2 (policy =
reference) and the loss falls. With LoRA, the base with its adapters disabled is the reference exactly."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from nightloom.chat import ChatSettings
from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from tests.support.chat import CHATML, QWEN2, build_chat_tokenizer, chat_messages
from tests.support.harness import make_job


def _pairs(n: int) -> list[dict]:
    convs = chat_messages(n, seed=13)
    return [
        {
            "prompt": c[:-1],
            "chosen": [c[-1]],
            "rejected": [{"role": "assistant", "content": " ".join(reversed(c[-1]["content"].split())) + " no"}],
        }
        for c in convs
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from nightloom.hf.random_model import build_random_model

    root = tmp_path_factory.mktemp("dpo")
    tok = build_chat_tokenizer(root / "tok")
    weights = build_random_model(root / "qwen2", "qwen2", seed=3, **QWEN2)
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in _pairs(24)), encoding="utf-8")
    chat = ChatSettings(template=CHATML, seq_len=128, task="dpo")
    sharding = ShardingSpec(output=str(root / "shards"), num_shards=2, tolerance=0.9, heldout=0.2)
    shard_dataset(DatasetSpec(path=str(data)), sharding, tokenizer=TokenizerSpec(path=str(tok)), chat=chat)
    return root, tok, weights


def _run(root: Path, tok: Path, weights: Path, name: str, steps: int, **job_kw) -> tuple[list[dict], str]:
    """One in-process run (a 1-rank group); its metrics rows and its stdout."""
    import contextlib
    import io

    from nightloom.train.job import TrainJob
    from nightloom.train.trainer import main

    train = {"task": "dpo", "preference": {"reference": "precomputed"}, "lr": 1e-3, "warmup_steps": 0, "export": "none"}
    path = make_job(
        root / "runs" / name,
        root / "shards",
        hf=weights,
        steps=steps,
        seq_len=128,
        global_batch=4,
        micro_batch=2,
        grad_accum=2,
        dp_shard=1,
        train_kw=train,
        job_kw={"tokenizer": TokenizerSpec(path=str(tok)), "eval_every": 2, **job_kw},
    )
    job = TrainJob.model_validate_json(path.read_text())
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(job)
    rows = [json.loads(line) for line in Path(job.metrics_path).read_text().splitlines()]
    return rows, buf.getvalue()


def test_precomputed_reference_is_transformers_and_is_reused_on_resume(setup):
    import transformers

    from nightloom.train.preference.data import PairRows
    from nightloom.train.preference.logps import sequence_logps

    root, tok, weights = setup
    os.environ.pop("MASTER_ADDR", None)
    rows, out = _run(root, tok, weights, "full", steps=4)
    assert "computed and stored" in out
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 1
    assert rows[0]["rewards/accuracies"] == 0.0 and rows[-1]["loss"] < rows[0]["loss"]
    assert rows[0]["start_eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    (table_file,) = (root / "shards" / "reference").glob("*.npy")
    table = __import__("numpy").load(table_file)

    pairs = PairRows(str(root / "shards"), seed=1234, tokenizer=TokenizerSpec(path=str(tok)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32).eval()
    batch = pairs.batch(0, 4)
    with torch.no_grad():
        chosen, rejected = sequence_logps(hf(batch.inputs).logits, batch.targets).halves()
    assert torch.allclose(torch.from_numpy(table[:4, 0]).float(), chosen.total, atol=1e-4)
    assert torch.allclose(torch.from_numpy(table[:4, 1]).float(), rejected.total, atol=1e-4)

    _, out = _run(root, tok, weights, "resumed", steps=2, stop_after_steps=2)
    _, out = _run(root, tok, weights, "resumed", steps=4)
    assert "resumed from" in out and "loaded from" in out
    table_file.unlink()
    with pytest.raises(RuntimeError, match="is missing: the initial weights are no longer in the model"):
        _run(root, tok, weights, "resumed", steps=6)


def test_adapters_disabled_is_the_base_exactly():
    from nightloom.catalog import get_model
    from nightloom.train.lora import LoraSettings, apply_lora
    from nightloom.train.model import build_model
    from nightloom.train.preference.reference import adapters_disabled

    torch.manual_seed(0)
    model = build_model(get_model("tiny"), 32, device="cpu")
    model.init_weights(0)
    x = torch.randint(0, 100, (2, 16))
    base = model(x).detach()
    apply_lora(model, LoraSettings(rank=4, alpha=8, dropout=0.0, modules=("q_proj", "v_proj", "down_proj")))
    for m in model.modules():
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B.weight)
            torch.nn.init.normal_(m.lora_A.weight)
    assert not torch.allclose(model(x), base)
    with adapters_disabled(model):
        assert torch.equal(model(x), base)
    assert not torch.allclose(model(x), base)  # restored
