"""train.task dpo on FSDP2 (2 ranks) and TP2 with sequence parallel equals one process over 3 steps: the step loss
(abs 1e-5), the pre-clip gradient norm (relative 1e-5) and the step's reward accuracy (from step 2: at step 1 the
rewards are 0 up to rounding, and the accuracy would count its sign); full fine-tuning against the
precomputed reference (scored once, shared through the shards folder) and LoRA against the base with its adapters
disabled; full fine-tuning against a frozen copy of the initial weights sharded as the policy
(train.preference.reference frozen_copy) equals the precomputed one-process run. SGD without clipping, so a layout that summed gradients instead of averaging them shows in the norm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nightloom.chat import ChatSettings
from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from tests.support.chat import CHATML, QWEN2, build_chat_tokenizer, chat_messages
from tests.support.harness import launch_many, make_job

STEPS = 3
SGD = {"optimizer": "sgd", "grad_clip": 1e9, "weight_decay": 0.0, "lr": 0.05, "warmup_steps": 0, "export": "none"}
LAYOUTS = {
    "fsdp2": {"dp_shard": 2, "micro_batch": 2, "grad_accum": 1},
    "tp2_sp": {"tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 2},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from nightloom.hf.random_model import build_random_model

    root = tmp_path_factory.mktemp("dpo-layouts")
    tok = build_chat_tokenizer(root / "tok")
    weights = build_random_model(root / "qwen2", "qwen2", seed=5, **QWEN2)
    rows = []
    for c in chat_messages(16, seed=31):
        wrong = " ".join(reversed(c[-1]["content"].split())) + " no"
        rows.append({"prompt": c[:-1], "chosen": [c[-1]], "rejected": [{"role": "assistant", "content": wrong}]})
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    chat = ChatSettings(template=CHATML, seq_len=128, task="dpo")
    sharding = ShardingSpec(output=str(root / "shards"), num_shards=2, tolerance=0.9)
    shard_dataset(DatasetSpec(path=str(path)), sharding, tokenizer=TokenizerSpec(path=str(tok)), chat=chat)
    return root, tok, weights


def _job(root: Path, tok: Path, weights: Path, name: str, plan: dict, lora: dict | None, ref="precomputed") -> Path:
    train = {"task": "dpo", **SGD, **({"lora": lora} if lora else {"preference": {"reference": ref}})}
    return make_job(
        root / "runs" / name,
        root / "shards",
        hf=weights,
        steps=STEPS,
        seq_len=128,
        global_batch=4,
        train_kw=train,
        job_kw={"tokenizer": TokenizerSpec(path=str(tok))},
        **plan,
    )


LORA = {"rank": 4, "alpha": 8, "targets": "all-linear"}


def test_fsdp2_and_tp2_equal_one_process(data):
    """Every kind (full, lora, copy) in two launches: the one-process references together, then every 2-rank
    layout."""
    root, tok, weights = data
    kinds = {"full": None, "lora": LORA}
    ones = {
        k: _job(root, tok, weights, f"one-{k}", {"micro_batch": 2, "grad_accum": 2}, lora) for k, lora in kinds.items()
    }
    jobs = {
        (k, name): _job(root, tok, weights, f"{name}-{k}", plan, lora)
        for k, lora in kinds.items()
        for name, plan in LAYOUTS.items()
    }
    for name, plan in LAYOUTS.items():  # full fine-tuning against a frozen copy sharded as the policy: the same run
        jobs["copy", name] = _job(root, tok, weights, f"{name}-copy", plan, None, "frozen_copy")
    refs = launch_many(1, list(ones.values()), timeout=300)
    runs = launch_many(2, list(jobs.values()), timeout=300)
    for (kind, name), job in jobs.items():
        one, run = refs[ones["full" if kind == "copy" else kind]], runs[job]
        assert len(one.metrics) == STEPS and one.losses[0] == pytest.approx(0.6931471805599453, abs=1e-6), kind
        assert one.losses[-1] < one.losses[0], kind
        assert len(run.metrics) == STEPS, f"{kind} {name}:\n{run.output[-4000:]}"
        for a, b in zip(run.metrics, one.metrics, strict=True):
            assert a.loss == pytest.approx(b.loss, abs=1e-5), (kind, name, a.step)
            assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5), (kind, name, a.step)
            if a.step == 1:  # policy = reference: every reward is 0 up to the layout's rounding, whose sign the
                # accuracy (chosen > rejected, TRL's) would count (0.25 against 0.0 for tp2_sp in one CI run)
                for fig in ("rewards/chosen", "rewards/rejected"):
                    assert abs(a.model_extra[fig]) < 1e-5 and abs(b.model_extra[fig]) < 1e-5, (kind, name, fig)
                continue
            acc = "rewards/accuracies"
            assert a.model_extra[acc] == pytest.approx(b.model_extra[acc], abs=1e-9), (kind, name, a.step)
