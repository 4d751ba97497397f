"""train.task grpo on 2 gloo ranks against one process, 3 steps of the tiny model with a verifiable reward: under TP2
the same completions are sampled and scored and the loss, the pre-clip gradient norm and the figures equal one
process's; under FSDP2 (shards gathered for the rollout, each DP rank its own prompts, each prompt group its own RNG
seeded by its global index, dapo's denominator and the figures over both ranks) the two ranks sample exactly the
completions one process samples, so the rewards equal one process's and the loss too (1e-5), step after step."""

from __future__ import annotations

import json

import pytest

from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from tests.support.harness import launch_groups, make_job

REWARD = """def digits(prompts, completions, answer, **row):
    return [0.5 * sum(c.isdigit() for c in t) / max(len(t), 1) + 0.5 * float(t[:1] == a) for t, a in zip(completions, answer)]
"""
STEPS = 3
LAYOUTS = {"one": (1, {"micro_batch": 8}), "tp2": (2, {"tp": 2, "micro_batch": 8}),
           "fsdp2": (2, {"dp_shard": 2, "micro_batch": 4})}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo-layouts")
    data = root / "prompts.jsonl"
    rows = [{"prompt": f"{'abcdefgh'[i % 8] * (1 + i % 3)}: {i % 5}+{i % 4}=", "answer": str(i % 5 + i % 4)}
            for i in range(40)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (root / "reward.py").write_text(REWARD)
    sharding = ShardingSpec(output=str(root / "shards"), num_shards=2, tolerance=0.9, heldout=0.25)
    dataset = DatasetSpec(path=str(data), text_field="prompt", keep_columns=["answer"])
    shard_dataset(dataset, sharding, tokenizer=TokenizerSpec(kind="bytes"))
    grpo = {"prompts_per_step": 2, "num_generations": 4, "max_completion_tokens": 5, "eval_prompts": 8,
            "rewards": [{"fn": f"{root / 'reward.py'}:digits"}]}  # fmt: skip
    train = {"task": "grpo", "grpo": grpo, "optimizer": "sgd", "grad_clip": 1e9, "weight_decay": 0.0, "lr": 0.5,
             "warmup_steps": 0, "export": "none"}  # fmt: skip
    jobs = {
        name: make_job(
            root / "runs" / name,
            root / "shards",
            steps=STEPS,
            seq_len=24,
            global_batch=8,
            train_kw=train,
            job_kw={"tokenizer": TokenizerSpec(kind="bytes"), "eval_every": STEPS},
            grad_accum=1,
            **plan,
        )
        for name, (_, plan) in LAYOUTS.items()
    }
    one, two = launch_groups((1, {"one": jobs["one"]}, 300), (2, {k: jobs[k] for k in ("tp2", "fsdp2")}, 300))
    out = {**one, **two}
    for name, (_, run) in out.items():
        assert run.rc == 0 and len(run.metrics) == STEPS, (name, run.output[-5000:])
    return {name: [m.model_dump() for m in run.metrics] for name, (_, run) in out.items()}


def test_tp2_samples_and_trains_as_one_process(runs):
    for a, b in zip(runs["one"], runs["tp2"], strict=True):
        assert b["reward"] == a["reward"] and b["completions/mean_length"] == a["completions/mean_length"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["num_tokens"] == a["num_tokens"]  # TP peers counted once
    assert runs["tp2"][-1]["eval_reward"] == pytest.approx(runs["one"][-1]["eval_reward"])


def test_fsdp2_samples_and_trains_as_one_process(runs):
    one, fsdp = runs["one"], runs["fsdp2"]
    assert fsdp[0]["start_eval_reward"] == pytest.approx(one[0]["start_eval_reward"])  # the same model, gathered
    for a, b in zip(one, fsdp, strict=True):  # the same completions over 2 ranks: the same rewards and loss
        assert b["reward"] == a["reward"] and b["reward_std"] == a["reward_std"]
        assert b["completions/mean_length"] == a["completions/mean_length"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["num_tokens"] == a["num_tokens"] and b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)
    assert max(r["grad_norm"] for r in one) > 0 and len({r["reward"] for r in one}) > 1  # a run that learns
