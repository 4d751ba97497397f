"""train.grpo.engine vllm on CUDA (needs vllm==0.32.0 importable; skipped without CUDA or vllm): vLLM's greedy
completions equal native generation's token for token on the tiny Llama, after one optimizer step the pushed
weights give vLLM's log-probs the trainer's within tolerance, and a 3-step GRPO run with the engine completes with
TRL's figures (with vLLM asleep between rollouts, and without)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from nightloom.hf.load import model_from_hf
from nightloom.spec import TokenizerSpec
from nightloom.spec.grpo import VLLMSpec
from nightloom.train.rollout.engine import GroupDraw, NativeEngine
from nightloom.train.rollout.generate import left_padded
from nightloom.train.rollout.logps import completion_logps, rollout_batch
from nightloom.train.rollout.sampling import SamplingParams
from nightloom.train.rollout.vllm_engine import VLLMEngine, model_folder
from tests.support.harness import launch, make_job
from tests.support.tiny_llama import save_tiny_llama

pytestmark = pytest.mark.gpu  # tests/conftest.py skips every gpu-marked test without CUDA


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama on the GPU in fp32, and one vLLM engine (fp32) colocated in this process."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("llama"))
    model = model_from_hf(folder, 64).cuda()
    shape = model_shape(folder)
    start = model_folder(shape, str(folder / "config.json"), None, "fp32")
    engine = VLLMEngine(start, shape, VLLMSpec(gpu_memory_utilization=0.2), seed=0, max_model_len=64,
                        dtype="fp32", eos_ids=[0], pad_id=0)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (3 + i,), generator=gen).tolist() for i in range(6)]
    return model, engine, prompts


def model_shape(folder):
    from nightloom.hf.config import shape_from_hf_config

    return shape_from_hf_config(folder)


def test_vllm_greedy_equals_native_greedy(tiny):
    model, engine, prompts = tiny
    engine.sync(model, 0)
    params, draw = SamplingParams(max_new_tokens=12, temperature=0.0), GroupDraw(0, 0, 0, len(prompts), 1)
    ours = NativeEngine([0], 0, None).generate(model, prompts, params, draw)
    theirs = engine.generate(model, prompts, params, draw)
    assert theirs.completion_ids() == ours.completion_ids()
    torch.testing.assert_close(theirs.logprobs, ours.logprobs, atol=1e-3, rtol=1e-3)


def test_pushed_weights_after_a_step_give_the_trainers_logprobs(tiny):
    model, engine, prompts = tiny
    params, draw = SamplingParams(max_new_tokens=8, temperature=0.0), GroupDraw(0, 0, 0, len(prompts), 1)
    engine.sync(model, 0)
    before = engine.generate(model, prompts, params, draw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([p[:3] for p in prompts], device="cuda")
    (-model(ids).float().log_softmax(-1)[..., 5].mean()).backward()  # push every row towards token 5
    opt.step()
    engine.sync(model, 1)
    after = engine.generate(model, prompts, params, draw)
    pids, pad = left_padded(prompts, None, 0)
    with torch.no_grad():
        trainer = completion_logps(model, rollout_batch(pids.cuda(), pad.cuda(), after))
    torch.testing.assert_close(after.logprobs, trainer, atol=2e-3, rtol=2e-3)
    changed = not torch.equal(before.tokens, after.tokens) or not torch.allclose(before.logprobs, after.logprobs)
    assert changed  # the push reached vLLM: its completions or their log-probs moved with the step


REWARD = "def digits(prompts, completions, **row):\n    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]\n"
TRL_NAMES = ("reward", "reward_std", "rewards/digits/mean", "completions/mean_length", "clip_ratio/region_mean",
             "entropy", "num_tokens", "generation_s")  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sleep", [False, True])
def test_three_grpo_steps_with_the_vllm_engine(tmp_path, sleep):
    from nightloom.sharding import shard_dataset
    from nightloom.spec import DatasetSpec, ShardingSpec

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i % 7}+{i % 5}="}) + "\n" for i in range(32)))
    (tmp_path / "reward.py").write_text(REWARD)
    sharding = ShardingSpec(output=str(tmp_path / "shards"), num_shards=1, tolerance=0.9, heldout=0.25)
    shard_dataset(DatasetSpec(path=str(data), text_field="prompt"), sharding, tokenizer=TokenizerSpec(kind="bytes"))
    grpo = {"prompts_per_step": 2, "num_generations": 4, "max_completion_tokens": 8, "engine": "vllm",
            "vllm": {"gpu_memory_utilization": 0.2, "sleep": sleep}, "eval_prompts": 4,
            "rewards": [{"fn": f"{tmp_path / 'reward.py'}:digits"}]}  # fmt: skip
    job = make_job(tmp_path / "run", tmp_path / "shards", steps=3, seq_len=32, global_batch=8, micro_batch=8,
                   grad_accum=1, dp_shard=1,
                   train_kw={"task": "grpo", "grpo": grpo, "precision": "bf16", "warmup_steps": 0, "export": "none"},
                   job_kw={"tokenizer": TokenizerSpec(kind="bytes"), "eval_every": 3})  # fmt: skip
    out = launch(1, job, timeout=560)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3], out.output[-3000:]
    assert all(name in r for r in rows for name in TRL_NAMES)
    assert "eval_reward" in rows[-1] and "start_eval_reward" in rows[0]
