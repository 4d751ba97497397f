"""train.lora on real ranks: the base frozen, adapters split as their base linear under TP (with and without SP),
sharded under FSDP2, per stage under PP. Every layout trains the same adapters as one process (losses and gradient
norms), step 1 is the base model's assistant-only NLL (B starts at 0), checkpoints hold the adapters only, and a
checkpoint saved under FSDP2 resumes under TP2 on the one-process curve."""

from __future__ import annotations

import pytest

from tests.support.chat import QWEN2, build_chat_tokenizer, chat_messages, transformers_sft_nll, write_chats
from tests.support.harness import launch, launch_many

SEQ = 192
GLOBAL = 8
STEPS = 4
TWO_RANKS = {
    "fsdp2": {"dp_shard": 2, "micro_batch": 2, "grad_accum": 2},
    "tp2": {"tp": 2, "micro_batch": 2, "grad_accum": 4},
    "tp2_sp": {"tp": 2, "sp": True, "micro_batch": 1, "grad_accum": 8},
    "pp2": {"pp": 2, "micro_batch": 2, "grad_accum": 4},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from nightloom.chat import ChatSettings, template_text
    from nightloom.hf.random_model import build_random_model
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec

    root = tmp_path_factory.mktemp("lora")
    tok = build_chat_tokenizer(root / "tok")
    train = chat_messages(GLOBAL, seed=11)  # one global batch: every step sees them all
    write_chats(root / "chats.jsonl", train)
    tspec = TokenizerSpec(path=str(tok))
    shard_dataset(
        DatasetSpec(path=str(root / "chats.jsonl")),
        ShardingSpec(output=str(root / "shards"), num_shards=2, tolerance=0.9),
        tokenizer=tspec,
        chat=ChatSettings(template=template_text(tok), seq_len=SEQ),
    )
    weights = build_random_model(root / "qwen2", "qwen2", seed=5, **QWEN2)
    return root, tspec, weights, train


def _job(run_dir, data, steps=STEPS, stop_after=None, checkpoint_every=0, **plan):
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import LoraSpec, TrainSpec
    from nightloom.train.job import TrainJob

    root, tspec, weights, _ = data
    run_dir.mkdir(parents=True, exist_ok=True)
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=shape_from_hf_config(weights / "config.json"),
        plan=ParallelPlan(**plan),
        train=TrainSpec(
            task="sft",
            steps=steps,
            seq_len=SEQ,
            global_batch=GLOBAL,
            lr=2e-2,
            warmup_steps=0,
            collective_timeout_s=60,
            checkpoint_every=checkpoint_every,
            lora=LoraSpec(rank=4, alpha=8.0),
        ),
        manifest=str(root / "shards"),
        peak_flops=50e9,
        peak_source="test constant",
        weights=str(weights),
        tokenizer=tspec,
        stop_after_steps=stop_after,
    )
    p = run_dir / "job.json"
    p.write_text(job.model_dump_json(indent=2), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    job = _job(tmp_path_factory.mktemp("run") / "single", data, micro_batch=2, grad_accum=4)
    return job, launch(1, job, timeout=240)


@pytest.fixture(scope="module")
def layouts(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    jobs = {name: _job(root / name, data, **plan) for name, plan in TWO_RANKS.items()}
    runs = launch_many(2, list(jobs.values()), timeout=600)
    return {name: runs[job] for name, job in jobs.items()}


def _checkpoint_tensors(run_dir):
    import torch
    import torch.distributed.checkpoint as dcp

    from nightloom.train.checkpoint import latest

    path, _ = latest(run_dir / "checkpoints")
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items() if k.startswith("model.")}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def test_one_process_trains_only_the_adapters_from_the_base_model(data, single):
    root, _, weights, train = data
    job, out = single
    assert len(out.losses) == STEPS, out.output[-3000:]
    assert (
        "LoRA rank 4 alpha 8 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj: 8,192 trainable" in out.output
    )
    # B starts at zero: step 1 is the base model's loss on its batch (the first GLOBAL conversations, shard order)
    assert out.losses[-1] < out.losses[0], out.losses
    state = _checkpoint_tensors(job.parent)
    adapters = [k for k in state if ".lora_" in k]
    assert len(adapters) == 2 * 7 * QWEN2["num_hidden_layers"], adapters  # A and B of 7 linears per layer
    assert any(state[k].abs().max() > 0 for k in adapters if "lora_B" in k)
    assert len(adapters) == len(state)  # over model.weights the checkpoint holds the adapters only (adapter_ckpt.py)


def test_step1_is_the_base_models_assistant_only_nll(data, single):
    root, _, weights, train = data
    _, out = single
    ref, tokens = transformers_sft_nll(weights, root / "tok", train)  # the one global batch holds every conversation
    assert abs(out.losses[0] - ref) < 1e-5, (out.losses[0], ref, tokens)


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_rank_layouts_train_the_same_adapters(single, layouts, name):
    _, ref = single
    out = layouts[name]
    assert len(out.losses) == STEPS, out.output[-4000:]
    for a, b in zip(out.metrics, ref.metrics):
        assert abs(a.loss - b.loss) < 1e-5, (name, a.step, a.loss, b.loss)
        assert abs(a.grad_norm - b.grad_norm) < 1e-4 * max(1.0, b.grad_norm), (name, a.step, a.grad_norm, b.grad_norm)


def test_fsdp2_checkpoint_resumes_under_tp2(data, single, tmp_path):
    _, ref = single
    first = _job(tmp_path / "run", data, stop_after=2, checkpoint_every=2, dp_shard=2, micro_batch=2, grad_accum=2)
    launch(2, first, timeout=240)
    second = _job(tmp_path / "run", data, tp=2, micro_batch=2, grad_accum=4)  # the same run folder: resumes
    out = launch(2, second, timeout=240)
    assert "resumed from" in out.output and [m.step for m in out.metrics] == [1, 2, 3, 4], out.output[-3000:]
    for a, b in zip(out.metrics, ref.metrics):
        assert abs(a.loss - b.loss) < 1e-5, (a.step, a.loss, b.loss)
