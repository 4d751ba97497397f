"""train.task sft on real ranks: one conversation per row, the loss over assistant tokens only. Step 1's loss (the
starting weights) equals the assistant-only NLL that transformers computes on the same conversations (prefix-rule
labels from its own apply_chat_template, the mean over every label token of the global batch) under one process,
FSDP2 on 2 ranks, PP2 and TP2; later steps and the held-out eval agree across layouts (the gradient is the
global mean's, however the batch is split)."""

from __future__ import annotations

import pytest

from tests.support.chat import QWEN2, build_chat_tokenizer, chat_messages, transformers_sft_nll, write_chats
from tests.support.harness import launch

SEQ = 192
GLOBAL = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from nightloom.chat import ChatSettings, template_text
    from nightloom.hf.random_model import build_random_model
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec

    root = tmp_path_factory.mktemp("sft")
    tok = build_chat_tokenizer(root / "tok")
    train, held = chat_messages(GLOBAL, seed=1), chat_messages(GLOBAL, seed=2)
    write_chats(root / "chats.jsonl", train)
    write_chats(root / "eval.jsonl", held, style="sharegpt")
    tspec = TokenizerSpec(path=str(tok))
    chat = ChatSettings(template=template_text(tok), seq_len=SEQ)
    m = shard_dataset(
        DatasetSpec(path=str(root / "chats.jsonl")),
        ShardingSpec(output=str(root / "shards"), num_shards=2, tolerance=0.9),
        tokenizer=tspec,
        chat=chat,
    )
    assert m.rows == GLOBAL and m.chat.cut == m.chat.dropped == 0  # every conversation in step 1's batch, whole
    weights = build_random_model(root / "qwen2", "qwen2", seed=5, **QWEN2)
    return root, tspec, weights, train, held


def _job(run_dir, data, **plan):
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    root, tspec, weights, _, _ = data
    run_dir.mkdir(parents=True, exist_ok=True)
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=shape_from_hf_config(weights / "config.json"),
        plan=ParallelPlan(**plan),
        train=TrainSpec(
            task="sft", steps=2, seq_len=SEQ, global_batch=GLOBAL, lr=1e-3, warmup_steps=0, collective_timeout_s=60
        ),
        manifest=str(root / "shards"),
        peak_flops=50e9,
        peak_source="test constant",
        weights=str(weights),
        tokenizer=tspec,
        eval_every=1,
        eval_windows=GLOBAL,
        eval_data=str(root / "eval.jsonl"),
    )
    p = run_dir / "job.json"
    p.write_text(job.model_dump_json(indent=2), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def reference(data):
    root, tspec, weights, train, held = data
    return transformers_sft_nll(weights, root / "tok", train), transformers_sft_nll(weights, root / "tok", held)


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    return launch(1, _job(tmp_path_factory.mktemp("run") / "single", data, micro_batch=2, grad_accum=4), timeout=240)


@pytest.mark.parametrize(
    "plan",
    [
        None,
        {"dp_shard": 2, "micro_batch": 2, "grad_accum": 2},
        {"pp": 2, "micro_batch": 2, "grad_accum": 4},
        {"tp": 2, "sp": True, "micro_batch": 1, "grad_accum": 8},
    ],
    ids=["1proc", "fsdp2", "pp2", "tp2_sp"],
)
def test_step1_loss_is_the_assistant_only_nll_of_transformers(data, reference, single, tmp_path, plan):
    out = single if plan is None else launch(2, _job(tmp_path / "run", data, **plan), timeout=240)
    (ref, tokens), (_, eval_tokens) = reference
    assert len(out.losses) == 2, out.output[-3000:]
    print(f"sft step 1: {out.losses[0]:.8f}, transformers {ref:.8f} over {tokens} assistant tokens")
    assert abs(out.losses[0] - ref) < 1e-5, (out.losses[0], ref)
    assert abs(out.losses[1] - single.losses[1]) < 1e-5 and out.losses[1] < out.losses[0]
    evals = [m for m in out.metrics if m.eval_loss is not None]
    assert [m.step for m in evals] == [1, 2] and all(m.eval_tokens == eval_tokens for m in evals)
    first = next(m for m in single.metrics if m.eval_loss is not None)
    assert abs(evals[0].eval_loss - first.eval_loss) < 1e-5
