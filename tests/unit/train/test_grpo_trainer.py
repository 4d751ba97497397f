"""train.task grpo in the native trainer, one process, on the tiny catalog model with the bytes tokenizer: prompts
and their `answer` column come from the shards (dataset.keep_columns), the steps carry TRL's figures and the
held-out mean reward (before the first step too), the completions table is written, and a run resumed from
its step-2 checkpoint samples and trains exactly as the run that went on (rollout RNG per step and rank)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from nightloom.train.data import DataError
from nightloom.train.rollout.prompts import PromptStream, PromptTable, to_prompts
from nightloom.train.rollout.step import Prompt
from tests.support.harness import make_job

REWARD = """def digits(prompts, completions, answer, **row):
    return [0.5 * sum(c.isdigit() for c in t) / max(len(t), 1) + 0.5 * float(t[:1] == a) for t, a in zip(completions, answer)]
"""
TRL_NAMES = ("reward", "reward_std", "rewards/digits/mean", "completions/mean_length", "completions/clipped_ratio",
             "clip_ratio/region_mean", "frac_reward_zero_std", "entropy", "num_tokens")  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    data = root / "prompts.jsonl"
    rows = [{"prompt": f"{'abcdefgh'[i % 8] * (1 + i % 3)}: {i % 5}+{i % 4}=", "answer": str(i % 5 + i % 4)}
            for i in range(48)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (root / "reward.py").write_text(REWARD)
    sharding = ShardingSpec(output=str(root / "shards"), num_shards=2, tolerance=0.9, heldout=0.25)
    dataset = DatasetSpec(path=str(data), text_field="prompt", keep_columns=["answer"])
    shard_dataset(dataset, sharding, tokenizer=TokenizerSpec(kind="bytes"))
    return root


def _run(root: Path, name: str, steps: int, **job_kw) -> tuple[list[dict], str]:
    from nightloom.train.job import TrainJob
    from nightloom.train.trainer import main

    grpo = {"prompts_per_step": 2, "num_generations": 4, "max_completion_tokens": 4, "iterations": 2,
            "rewards": [{"fn": f"{root / 'reward.py'}:digits"}], "eval_prompts": 8, "log_completions_every": 2}  # fmt: skip
    path = make_job(
        root / "runs" / name,
        root / "shards",
        steps=steps,
        seq_len=24,
        global_batch=8,
        micro_batch=8,
        grad_accum=1,
        dp_shard=1,
        train_kw={"task": "grpo", "grpo": grpo, "lr": 1e-2, "warmup_steps": 0, "export": "none", "checkpoint_every": 2},
        job_kw={"tokenizer": TokenizerSpec(kind="bytes"), "eval_every": 2, **job_kw},
    )
    job = TrainJob.model_validate_json(path.read_text())
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(job)
    rows = [json.loads(line) for line in Path(job.metrics_path).read_text().splitlines()]
    return rows, buf.getvalue()


def test_grpo_steps_figures_table_and_the_same_curve_after_a_resume(setup):
    os.environ.pop("MASTER_ADDR", None)
    whole, out = _run(setup, "whole", steps=4)
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    assert all(name in row for row in whole for name in TRL_NAMES)
    assert "start_eval_reward" in whole[0] and "eval_reward_se" in whole[-1]
    assert "eval step 0: held-out mean reward" in out
    table = json.loads((setup / "runs" / "whole" / "completions" / "step-000004.json").read_text())
    assert len(table["rows"]) == 8 and {"prompt", "completion", "reward", "digits", "advantage"} <= set(
        table["rows"][0]
    )
    assert table["rows"][0]["prompt"].endswith("=")  # the prompt's text from the shards

    (setup / "runs" / "resumed" / "checkpoints").mkdir(parents=True)  # the whole run's step-2 checkpoint
    shutil.copytree(
        setup / "runs" / "whole" / "checkpoints" / "step-2", setup / "runs" / "resumed" / "checkpoints" / "step-2"
    )
    (setup / "runs" / "resumed" / "checkpoints" / "latest").write_text("step-2\n")
    lines = (setup / "runs" / "whole" / "metrics.jsonl").read_text().splitlines(keepends=True)[:2]
    (setup / "runs" / "resumed" / "metrics.jsonl").write_text("".join(lines))  # the first attempt's steps 1-2
    resumed, out = _run(setup, "resumed", steps=4, eval_every=0)
    assert "resumed from" in out
    for a, b in zip(whole[2:], resumed[-2:], strict=True):  # steps 3 and 4: the same samples, the same update
        for k in ("loss", "reward", "rewards/digits/mean", "completions/mean_length", "grad_norm", "num_tokens"):
            assert b[k] == pytest.approx(a[k], abs=1e-6), (k, a[k], b[k])


def test_prompts_each_rank_a_slice_of_a_seeded_round():
    prompts = [Prompt([i + 1], str(i)) for i in range(10)]
    ranks = [PromptStream(prompts, 4, seed=3, dp=2, dp_rank=k) for k in (0, 1)]
    one = PromptStream(prompts, 4, seed=3, dp=1, dp_rank=0)
    for r in (0, 1, 7):  # round 7 wraps round the 10 prompts
        assert ranks[0].round(r) + ranks[1].round(r) == one.round(r)
    assert one.round(0) != PromptStream(prompts, 4, seed=4, dp=1, dp_rank=0).round(0)
    with pytest.raises(ValueError, match="prompts_per_step: 4 is not a multiple of the 3 data-parallel ranks"):
        PromptStream(prompts, 4, seed=3, dp=3, dp_rank=0)


def test_a_prompt_too_long_for_the_completion_is_named():
    from nightloom.tokenizer import load_tokenizer

    tok = load_tokenizer(TokenizerSpec(kind="bytes"))
    table = PromptTable("shards/manifest.json", ["ok", "much too long"], {"answer": ["1", "2"]})
    got = to_prompts(table, tok, 13)
    assert got[0] == Prompt([ord("o"), ord("k")], "ok", {"answer": "1"}) and got[1].columns == {"answer": "2"}
    with pytest.raises(DataError, match="prompt 1 has 13 tokens; train.seq_len minus train.grpo.max_completion"):
        to_prompts(table, tok, 12)


def test_eval_data_prompts_are_read_as_the_shards_store_them(setup, tmp_path):
    from nightloom.train.rollout.prompts import read_prompt_file

    good = tmp_path / "eval.jsonl"
    good.write_text('{"prompt": "a: 1+2=", "answer": 3}\n\n{"prompt": "b: 0+0=", "answer": "0", "other": 1}\n')
    table = read_prompt_file(str(good), str(setup / "shards"), None)
    assert table.texts == ["a: 1+2=", "b: 0+0="] and table.columns == {"answer": ["3", "0"]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a: 1+2=", "answer": "3"}\n{"prompt": "b: 0+0="}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: answer: missing"):
        read_prompt_file(str(bad), str(setup / "shards"), None)
