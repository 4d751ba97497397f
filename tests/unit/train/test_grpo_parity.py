"""Parity of the GRPO objective (nightloom.train.rollout.grpo) with TRL 1.16's GRPOTrainer on one fixed batch of a
tiny Qwen2: fixed prompts, completions (some ending in EOS, some cut at max tokens), rewards (one group all
equal), old log-probs off the current policy (so ratios clip) and reference log-probs. TRL's own
`_generate_and_score_completions` (its generation replaced by the fixed completions) gives the advantages and its
`_compute_loss` the loss and gradients; ours must equal them within 1e-5 for grpo, dr_grpo and dapo, beta 0 and
0.04, and the logged figures (kl, clip ratios, reward, reward_std, per-function means) too."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from nightloom.train.rollout.grpo import GRPOLossSettings, group_advantages, grpo_loss, loss_mask, rollout_metrics
from tests.support.chat import QWEN2, build_chat_tokenizer

pytest.importorskip("trl")
TOL = 1e-5
G, MAX_NEW = 4, 6
PROMPTS = ["alpha beta gamma", "delta epsilon"]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.3, 0.3, 0.3, 0.3]  # the second group has no spread: advantage 0
LENGTHS = [6, 3, 6, 1, 4, 6, 2, 5]  # 6 without EOS: truncated


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    tok_dir = build_chat_tokenizer(tmp_path_factory.mktemp("tok"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    model_dir = tmp_path_factory.mktemp("policy")
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2, tie_word_embeddings=False)).float().save_pretrained(
        model_dir
    )
    gen = torch.Generator().manual_seed(1)
    eos = tok.eos_token_id
    completions = []
    for n in LENGTHS:
        ids = torch.randint(10, 300, (n,), generator=gen).tolist()
        if n < MAX_NEW:
            ids[-1] = eos
        completions.append(ids)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS for _ in range(G)]
    return SimpleNamespace(tok=tok, model_dir=model_dir, completions=completions, prompt_ids=prompt_ids, eos=eos)


@pytest.fixture(scope="module")
def trl(setup, tmp_path_factory):
    """One GRPOTrainer (built once: about 3 s); each test sets the settings it compares."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def fixed(prompts, completions, **kw):
        return list(REWARDS)

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        per_device_train_batch_size=len(REWARDS),
        num_generations=G,
        max_completion_length=MAX_NEW,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        temperature=1.0,
    )
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS for _ in range(G)])
    trainer = GRPOTrainer(
        model=str(setup.model_dir),
        reward_funcs=fixed,
        args=args,
        train_dataset=dataset,
        processing_class=setup.tok,
    )
    texts = [setup.tok.decode(c) for c in setup.completions]
    trainer._generate = lambda prompts: (setup.prompt_ids, setup.completions, None, texts, None, {}, None, None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop, which the tests do not run
    return trainer, [dataset[i] for i in range(len(dataset))]


def _scored(trl, loss_type: str, scale: str = "group", mask_truncated: bool = False):
    """TRL's inputs for the fixed batch (advantages, masks) under these settings, beta 0 while scoring (its
    reference log-probs are replaced by the fixed ones anyway)."""
    trainer, batch = trl
    trainer.beta, trainer.loss_type, trainer.scale_rewards = 0.0, loss_type, scale
    trainer.mask_truncated_completions = mask_truncated
    trainer._metrics["train"].clear()
    return trainer, trainer._generate_and_score_completions(batch)


def _fixed_logps(trainer, inputs):
    """(the policy's log-probs of the completions, with grad; old and reference log-probs moved off them)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, inputs["completion_ids"].shape[1])[0]
    gen = torch.Generator().manual_seed(2)
    old = logps.detach() + 0.3 * torch.randn(logps.shape, generator=gen)
    ref = logps.detach() + 0.5 * torch.randn(logps.shape, generator=gen)
    return logps, old, ref


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradients_equal_trl(trl, loss_type, beta):
    trainer, inputs = _scored(trl, loss_type, mask_truncated=loss_type == "dapo")
    trainer.beta = beta
    model = trainer.model
    logps, old, ref = _fixed_logps(trainer, inputs)
    inputs["old_per_token_logps"] = old
    inputs["ref_per_token_logps"] = ref
    trainer._metrics["train"].clear()
    model.zero_grad()
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    adv = group_advantages(torch.tensor(REWARDS), G, "group")
    assert torch.allclose(adv.values, inputs["advantages"], atol=TOL, rtol=0)
    truncated = torch.tensor([n == MAX_NEW for n in LENGTHS])
    own = torch.arange(MAX_NEW)[None, :] < torch.tensor(LENGTHS)[:, None]
    mask = loss_mask(own, truncated, mask_truncated=loss_type == "dapo")
    assert torch.equal(mask, inputs["completion_mask"].float())
    settings = GRPOLossSettings(loss_type, 0.2, 0.28, beta, MAX_NEW)
    model.zero_grad()
    ours = grpo_loss(logps, old, adv.values, mask, settings, ref_logps=ref if beta else None)
    ours.loss.backward()

    assert abs(float(ours.loss) - float(trl_loss)) < TOL
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, trl_grads[name], atol=TOL, rtol=0), name
    assert any(float(g.abs().max()) > 1e-4 for g in trl_grads.values())  # a real gradient, not zeros
    clip = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min")
    for name in clip + ("clip_ratio/high_max",) + (("kl",) if beta else ()):
        assert abs(ours.metrics[name] - trl_metrics[name]) < TOL, name
    assert ours.metrics["clip_ratio/region_mean"] > 0  # the ratios do clip: the clipped branch is exercised


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_and_reward_figures_equal_trl(trl, scale):
    trainer, inputs = _scored(trl, "dapo", scale)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    adv = group_advantages(torch.tensor(REWARDS), G, scale)
    assert torch.allclose(adv.values, inputs["advantages"], atol=TOL, rtol=0)
    lengths = torch.tensor(LENGTHS)
    figures = rollout_metrics(
        torch.tensor(REWARDS)[:, None], ("fixed",), torch.ones(1), lengths, lengths == MAX_NEW, adv
    )
    for name in ("reward", "reward_std", "rewards/fixed/mean", "rewards/fixed/std", "frac_reward_zero_std"):
        assert abs(figures[name] - trl_metrics[name]) < TOL, name
    ended = [n for n in LENGTHS if n < MAX_NEW]  # TRL's terminated lengths: of the completions that ended
    assert figures["completions/min_terminated_length"] == min(ended)
    assert figures["completions/max_terminated_length"] == max(ended)


def test_dapo_denominator_is_the_generation_batch_tokens():
    """Split one batch in two micro-batches with num_tokens = the whole batch's: the two losses add up to one."""
    gen = torch.Generator().manual_seed(0)
    logps = torch.randn(4, 5, generator=gen).clamp(max=0)
    old = logps + 0.1 * torch.randn(4, 5, generator=gen)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]).float()
    s = GRPOLossSettings("dapo")
    whole = grpo_loss(logps, old, adv, mask, s).loss
    halves = [
        grpo_loss(logps[i], old[i], adv[i], mask[i], s, num_tokens=mask.sum()).loss for i in (slice(0, 2), slice(2, 4))
    ]
    assert abs(float(whole) - float(sum(halves))) < 1e-6
    grpo_whole = grpo_loss(logps, old, adv, mask, GRPOLossSettings("grpo")).loss
    assert abs(float(grpo_whole) - float(whole)) > 1e-3  # the normalisations differ on unequal lengths
    with pytest.raises(ValueError, match="beta > 0 needs the reference"):
        grpo_loss(logps, old, adv, mask, GRPOLossSettings(beta=0.1))


def test_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="multiple of the group size 3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="reward scale 'std'"):
        group_advantages(torch.zeros(4), 2, "std")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss type 'bnpo'"):
        grpo_loss(torch.zeros(1, 2), None, torch.zeros(1), torch.ones(1, 2), GRPOLossSettings("bnpo"))  # type: ignore[arg-type]
    assert copy.copy(GRPOLossSettings()).beta == 0.0  # TRL's default now: no KL term
