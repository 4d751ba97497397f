"""One GRPO step from generation to backward (nightloom.train.rollout.step) on a tiny random Llama in one process:
the figures carry TRL's names, a batch generated for a step is generated again at that step (resume), and a few
steps of AdamW on a verifiable reward (the share of completion tokens that are token 7, a user function in a file)
raise the held-out mean reward by more than three standard errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nightloom.hf.load import model_from_hf
from nightloom.hf.random_model import build_random_model
from nightloom.rewards.resolve import RewardRef, load_rewards
from nightloom.spec.grpo import GRPOSpec
from nightloom.train.rollout.step import GRPOSettings, GRPOStep, Prompt

CONFIG = {
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
REWARD = "def sevens(prompts, completions, completion_ids, **row):\n    return [sum(i == 7 for i in c) / max(len(c), 1) for c in completion_ids]\n"


@pytest.fixture
def setup(tmp_path):
    torch.manual_seed(0)
    folder = build_random_model(tmp_path / "w", "llama", seed=2, **CONFIG)
    (tmp_path / "reward.py").write_text(REWARD)
    rewards = load_rewards([RewardRef("reward.py:sevens")], tmp_path)
    spec = GRPOSpec(num_generations=8, max_completion_tokens=8, rewards=[{"fn": "reward.py:sevens"}])
    step = GRPOStep(GRPOSettings.from_spec(spec, micro_batch=16), rewards, str, eos_ids=[1], pad_id=0, seed=3)
    gen = torch.Generator().manual_seed(1)
    prompts = [Prompt(torch.randint(2, 32, (3 + i % 4,), generator=gen).tolist(), "") for i in range(40)]
    return model_from_hf(folder, 64), step, prompts


def test_figures_and_the_same_batch_after_a_resume(setup):
    model, step, prompts = setup
    a, b = step.rollout(model, prompts[:2], 4), step.rollout(model, prompts[:2], 4)
    assert torch.equal(a.rollout.tokens, b.rollout.tokens)
    assert not torch.equal(a.rollout.tokens, step.rollout(model, prompts[:2], 5).rollout.tokens)
    loss, figures = step.train(model, a)
    for name in ("reward", "reward_std", "rewards/sevens/mean", "completions/mean_length", "clip_ratio/region_mean"):
        assert name in figures, name
    assert figures["completions/clipped_ratio"] == float(a.rollout.truncated.float().mean())
    assert any(p.grad is not None and float(p.grad.abs().max()) > 0 for p in model.parameters())


def test_two_data_parallel_ranks_sample_what_one_process_samples(setup):
    model, step, prompts = setup
    one = step.rollout(model, prompts[:4], 6)
    rank = [GRPOStep(step.s, step.rewards, str, eos_ids=[1], pad_id=0, seed=3, dp_rank=k) for k in (0, 1)]
    ranks = [rank[k].rollout(model, prompts[2 * k : 2 * k + 2], 6) for k in (0, 1)]  # each its own padding
    assert one.rollout.completion_ids() == [c for r in ranks for c in r.rollout.completion_ids()]
    assert torch.equal(one.scores.total, torch.cat([r.scores.total for r in ranks]))


def test_entropy_and_num_tokens_are_trls(setup, tmp_path):
    from trl.trainer.utils import entropy_from_logits

    from nightloom.metrics import StepMetrics, append_metrics
    from nightloom.train.rollout.logps import rollout_batch
    from nightloom.train.rollout.task import generated_tokens, resumed_num_tokens

    model, step, prompts = setup
    batch = step.rollout(model, prompts[:3], 2)
    whole = rollout_batch(batch.prompt_ids, batch.pad, batch.rollout)
    with torch.no_grad():  # TRL: the entropy of softmax(logits / temperature) at each completion position
        logits = model(whole.ids, doc_ids=whole.doc_ids)[:, whole.prompt_len - 1 : -1].float()
        ent = entropy_from_logits(logits / step.s.sampling.temperature)
    mask = batch.rollout.mask.float()
    trl_entropy = float((ent * mask).sum() / mask.sum())  # global_masked_mean over the loss mask
    small = GRPOStep(replace(step.s, micro_batch=5), step.rewards, str, eos_ids=[1], pad_id=0, seed=3)
    assert small.train(model, batch)[1]["entropy"] == pytest.approx(trl_entropy, rel=1e-5)
    ids = batch.rollout.completion_ids()  # TRL: sum(prompt_lengths) + sum(completion_lengths), per completion
    assert generated_tokens([p.ids for p in batch.prompts], batch.rollout.lengths) == sum(
        len(p.ids) + len(c) for p, c in zip(batch.prompts, ids, strict=True)
    )
    path = tmp_path / "metrics.jsonl"  # a resume goes on from the total at its checkpoint's step
    for k, total in ((1, 40), (2, 90), (3, 130)):
        append_metrics(path, StepMetrics(step=k, loss=0.0, num_tokens=float(total)))
    assert resumed_num_tokens(path, 2) == 90 and resumed_num_tokens(tmp_path / "none.jsonl", 2) == 0


def test_a_few_steps_raise_the_held_out_reward(setup):
    model, step, prompts = setup
    train, heldout = prompts[:8], prompts[8:]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    before = step.evaluate(model, heldout)
    for k in range(30):
        batch = step.rollout(model, train[(k % 4) * 2 : (k % 4) * 2 + 2], k)
        step.train(model, batch)
        opt.step()
        opt.zero_grad()
    after = step.evaluate(model, heldout)
    se = (before["reward_se"] ** 2 + after["reward_se"] ** 2) ** 0.5
    print(f"held-out reward {before['reward']:.3f} -> {after['reward']:.3f} (3 SE {3 * se:.3f})")
    assert after["reward"] - before["reward"] > 3 * se, (before, after)


def test_beta_takes_the_kl_to_the_base_with_the_adapters_off(tmp_path):
    """beta > 0 with LoRA: the reference is the same model with its adapters off. Fresh adapters (B = 0) are the
    base: KL 0; moved adapters: KL > 0, and the loss changes with beta."""
    from nightloom.catalog import get_model
    from nightloom.train.lora import LoraSettings, apply_lora, init_lora
    from nightloom.train.model import build_model

    torch.manual_seed(0)
    model = build_model(get_model("tiny"), 32, device="cpu")
    model.init_weights(0)
    apply_lora(model, LoraSettings(rank=4, alpha=8, dropout=0.0, modules=("q_proj", "v_proj")))
    init_lora(model, 0)  # B = 0: the adapted model is the base
    (tmp_path / "reward.py").write_text(REWARD)
    rewards = load_rewards([RewardRef("reward.py:sevens")], tmp_path)
    prompts = [Prompt([3, 9, 4], ""), Prompt([5, 6], "")]

    def step(beta: float) -> GRPOStep:
        spec = GRPOSpec(num_generations=4, max_completion_tokens=4, beta=beta, rewards=[{"fn": "reward.py:sevens"}])
        return GRPOStep(GRPOSettings.from_spec(spec, micro_batch=8), rewards, str, eos_ids=[1], pad_id=0, seed=3)

    batch = step(0.04).rollout(model, prompts, 0)
    _, fresh = step(0.04).train(model, batch)
    assert fresh["kl"] == pytest.approx(0.0, abs=1e-7)
    for m in model.modules():
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B.weight, std=0.5)
    loss_kl, moved = step(0.04).train(model, batch)
    loss_plain, plain = step(0.0).train(model, batch)
    assert moved["kl"] > 1e-4 and "kl" not in plain and loss_kl != pytest.approx(loss_plain)


def test_figures_do_not_depend_on_the_micro_batch(setup):
    """A step's figures from micro-batches of 3 completions equal one forward's: means weighted by rows, a `_min`
    figure the least (clip_ratio/low_min), a `_max` the largest."""
    from nightloom.train.rollout.step import reduction

    model, step, prompts = setup
    batch = step.rollout(model, prompts[:2], 0)
    with torch.no_grad():  # the ratio moves off 1, so some tokens clip
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    _, whole = step.train(model, batch)
    small = GRPOStep(
        GRPOSettings(step.s.sampling, step.s.group, step.s.loss, micro_batch=3), step.rewards, str, [1], 0, seed=3
    )
    _, parts = small.train(model, batch)
    assert whole.keys() == parts.keys() and whole["clip_ratio/region_mean"] > 0
    for k in whole:
        assert parts[k] == pytest.approx(whole[k], abs=1e-6), k
    assert [reduction(k) for k in ("clip_ratio/low_min", "completions/max_length", "rewards/max_x/mean")] == [
        "min",
        "max",
        "mean",
    ]
