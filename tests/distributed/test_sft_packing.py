"""train.pack on real ranks. 16 conversations pack into R rows; a packed run's global batch of 2R rows holds every
conversation exactly twice, an unpacked run's batch of 16 rows each once, so both steps are the mean over the
same conversations' label tokens: step 1's loss equals transformers' assistant-only NLL of the 16 conversations
run one by one, and the losses and grad norms of 3 steps agree between the packed run in one process, under
FSDP2 on 2 ranks, under TP2 with SP, and the unpacked run (what differs is only how the rows are cut)."""

from __future__ import annotations

import json

import pytest

from tests.support.chat import QWEN2, build_chat_tokenizer, chat_messages, transformers_sft_nll, write_chats
from tests.support.harness import launch_many

SEQ = 256
CONVS = 16
STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from nightloom.chat import ChatSettings, template_text
    from nightloom.hf.random_model import build_random_model
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec, TrainSpec
    from nightloom.train.data import ConversationRows

    root = tmp_path_factory.mktemp("sftpack")
    tok = build_chat_tokenizer(root / "tok")
    convs = chat_messages(CONVS, seed=4)
    write_chats(root / "chats.jsonl", convs)
    tspec = TokenizerSpec(path=str(tok))
    m = shard_dataset(
        DatasetSpec(path=str(root / "chats.jsonl")),
        ShardingSpec(output=str(root / "shards"), num_shards=2, tolerance=0.9),
        tokenizer=tspec,
        chat=ChatSettings(template=template_text(tok), seq_len=SEQ),
    )
    assert m.rows == CONVS and m.chat.cut == m.chat.dropped == 0
    rows = ConversationRows(str(root / "shards"), SEQ, seed=TrainSpec().seed, tokenizer=tspec, pack=True)
    assert rows.total < CONVS // 2, rows.stats().line()  # more than 2 conversations per row
    weights = build_random_model(root / "qwen2", "qwen2", seed=5, **QWEN2)
    return root, tspec, weights, convs, rows.total


def _job(run_dir, data, global_batch, pack, **plan):
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    root, tspec, weights, _, _ = data
    run_dir.mkdir(parents=True, exist_ok=True)
    train = TrainSpec(
        task="sft",
        pack=pack,
        steps=STEPS,
        seq_len=SEQ,
        global_batch=global_batch,
        lr=1e-3,
        warmup_steps=0,
        collective_timeout_s=60,
    )
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=shape_from_hf_config(weights / "config.json"),
        plan=ParallelPlan(**plan),
        train=train,
        manifest=str(root / "shards"),
        peak_flops=50e9,
        peak_source="test constant",
        weights=str(weights),
        tokenizer=tspec,
    )
    p = run_dir / "job.json"
    p.write_text(job.model_dump_json(indent=2), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    r = data[4]
    tmp = tmp_path_factory.mktemp("runs")
    one = {
        "unpacked": _job(tmp / "unpacked", data, CONVS, False, micro_batch=2, grad_accum=CONVS // 2),
        "packed": _job(tmp / "packed", data, 2 * r, True, micro_batch=1, grad_accum=2 * r),
    }
    two = {
        "fsdp2": _job(tmp / "fsdp2", data, 2 * r, True, dp_shard=2, micro_batch=1, grad_accum=r),
        "tp2_sp": _job(tmp / "tp2", data, 2 * r, True, tp=2, sp=True, micro_batch=1, grad_accum=2 * r),
    }
    out = {k: v for k, v in zip(one, launch_many(1, list(one.values()), timeout=600).values())}
    out |= {k: v for k, v in zip(two, launch_many(2, list(two.values()), timeout=600).values())}
    out["jobs"] = {**one, **two}
    return out


def test_packed_sft_equals_the_conversations_one_by_one_under_every_layout(data, runs):
    root, _, weights, convs, r = data
    ref, tokens = transformers_sft_nll(weights, root / "tok", convs)
    unpacked = runs["unpacked"]
    for name in ("unpacked", "packed", "fsdp2", "tp2_sp"):
        out = runs[name]
        assert len(out.losses) == STEPS, (name, out.output[-3000:])
        norms = [m.grad_norm for m in out.metrics]
        print(f"{name}: losses {out.losses} grad norms {norms}")
        assert abs(out.losses[0] - ref) < 1e-5, (name, out.losses[0], ref, tokens)
        for a, b in zip(out.losses, unpacked.losses):
            assert abs(a - b) < 1e-5, (name, out.losses, unpacked.losses)
        for a, b in zip(norms, [m.grad_norm for m in unpacked.metrics]):
            assert abs(a - b) <= 1e-5 * max(1.0, b), (name, norms)
        assert out.losses[-1] < out.losses[0]
    assert f"packing: {CONVS} conversations in {r} rows of {SEQ + 1} ids" in runs["packed"].output
    result = json.loads((runs["jobs"]["packed"].parent / "result.json").read_text())
    assert result["conversations_per_row"] == CONVS / r and 0 < result["pack_fill"] <= 1
    assert json.loads((runs["jobs"]["unpacked"].parent / "result.json").read_text())["conversations_per_row"] is None


def test_pack_refuses_pipeline_and_context_parallel(data, tmp_path):
    from nightloom.train.job import TrainJob
    from nightloom.train.trainer import check_pack

    job = TrainJob.model_validate_json(
        _job(tmp_path / "pp", data, 8, True, pp=2, micro_batch=1, grad_accum=4).read_text()
    )
    with pytest.raises(ValueError, match=r"train.pack: packed sequences need pp = 1 and cp = 1, the layout .* pp 2"):
        check_pack(job)
