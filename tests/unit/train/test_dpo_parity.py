"""Parity of nightloom's preference losses with TRL 1.16 on one fixed batch of a tiny Qwen2: the loss, the rewards
(and TRL's other logged figures) and every parameter's gradient within 1e-5. sigmoid and ipo through
DPOTrainer.compute_loss itself (its tokenization, collator and concatenated forward); simpo and ORPO's odds-ratio
term through CPOTrainer's and ORPOTrainer's own log-prob and loss functions on the same forward."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from nightloom.train.preference.logps import IGNORE_INDEX, sequence_logps
from nightloom.train.preference.losses import LossSettings, orpo_odds_ratio, pair_loss, smoothed_sigmoid
from nightloom.train.preference.metrics import PairSums
from tests.support.chat import QWEN2, build_chat_tokenizer, chat_messages

pytest.importorskip("trl")
TOL = 1e-5


def _pairs(n: int = 4) -> list[dict]:
    """Conversational pairs: a prompt, the conversation's answer as chosen, another's as rejected."""
    convs = chat_messages(2 * n, seed=5)
    out = []
    for i in range(n):
        prompt = [m for m in convs[i][:-1]]
        chosen = [convs[i][-1]]
        rejected = [{"role": "assistant", "content": convs[n + i][-1]["content"] + " no"}]
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    folder = build_chat_tokenizer(tmp_path_factory.mktemp("tok"))
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    cfg = transformers.Qwen2Config(**QWEN2, tie_word_embeddings=False)
    policy = transformers.Qwen2ForCausalLM(cfg).float()
    reference = copy.deepcopy(policy)
    with torch.no_grad():  # a reference that differs, so the log-ratios (and rewards) are not all 0
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return SimpleNamespace(tok=tok, policy=policy, reference=reference, out=tmp_path_factory.mktemp("out"))


def _trl_dpo(setup, loss_type: str, beta: float):
    """TRL's DPOTrainer on the pairs: (loss, its logged metrics, the grads, the collated batch)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model = copy.deepcopy(setup.policy)
    args = DPOConfig(
        output_dir=str(setup.out),
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        beta=beta,
        loss_type=[loss_type],
        per_device_train_batch_size=4,
        dataset_num_proc=None,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(setup.reference),
        args=args,
        train_dataset=Dataset.from_list(_pairs()),
        processing_class=setup.tok,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(loss.detach()), metrics, grads, batch


def _shifted(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, attention mask, targets) as nightloom's trainer holds them: targets[t] is what input t predicts,
    IGNORE_INDEX outside the completions."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    targets = ids[:, 1:].masked_fill(batch["completion_mask"][:, 1:] == 0, IGNORE_INDEX)
    return ids, mask, targets


@pytest.mark.parametrize(("loss_type", "beta"), [("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.1)])
def test_dpo_and_ipo_equal_trl_dpo_trainer(setup, loss_type, beta):
    trl_loss, trl_metrics, trl_grads, batch = _trl_dpo(setup, loss_type, beta)
    ids, mask, targets = _shifted(batch)
    model = copy.deepcopy(setup.policy)
    model.train()
    with torch.no_grad():
        ref = sequence_logps(setup.reference(ids, attention_mask=mask).logits[:, :-1], targets).halves()
    policy = sequence_logps(model(ids, attention_mask=mask).logits[:, :-1], targets).halves()
    result = pair_loss(policy, (ref[0].total, ref[1].total), LossSettings(loss=loss_type, beta=beta))
    loss = result.losses.mean()
    loss.backward()
    assert abs(float(loss) - trl_loss) < TOL
    sums = PairSums()
    sums.add(result, policy, logps_mean=False)
    figures = sums.figures()
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert abs(figures[name] - trl_metrics[name]) < TOL, name
    assert abs(figures["logps/rejected"] - trl_metrics["logps/rejected"]) < TOL
    assert figures["rewards/margins"] != 0.0  # the reference differs: a real comparison
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, trl_grads[name], atol=TOL, rtol=0), name


def _trl_namespace(**kw):
    """The attributes TRL's CPO/ORPO loss methods read from their trainer."""
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), alpha=0.0, **kw)


def _collated(setup):
    _, _, _, batch = _trl_dpo(setup, "sigmoid", 0.1)
    return batch


@pytest.fixture(scope="module")
def batch(setup):
    return _collated(setup)


def _policy_logits(setup, batch):
    model = copy.deepcopy(setup.policy)
    model.train()
    return model, model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_equals_trl_cpo_trainer(setup, batch, label_smoothing):
    from trl.experimental.cpo import CPOTrainer

    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    s = LossSettings(loss="simpo", beta=0.1, label_smoothing=label_smoothing, simpo_gamma=0.5)
    ns = _trl_namespace(loss_type="simpo", beta=0.1, simpo_gamma=0.5, label_smoothing=label_smoothing)

    theirs, logits = _policy_logits(setup, batch)
    all_logps = CPOTrainer.get_batch_logps(logits, labels.clone(), average_log_prob=True)
    losses, c_rew, r_rew = CPOTrainer.cpo_loss(ns, *all_logps.chunk(2))
    losses.mean().backward()

    ours, logits = _policy_logits(setup, batch)
    policy = sequence_logps(logits[:, :-1], labels[:, 1:]).halves()
    result = pair_loss(policy, None, s)
    result.losses.mean().backward()

    assert torch.allclose(result.losses, losses, atol=TOL, rtol=0)
    assert torch.allclose(result.chosen_rewards, c_rew, atol=TOL, rtol=0)
    assert torch.allclose(result.rejected_rewards, r_rew, atol=TOL, rtol=0)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=TOL, rtol=0), name


def test_orpo_odds_ratio_equals_trl_orpo_trainer(setup, batch):
    from trl.experimental.orpo import ORPOTrainer

    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    ns = _trl_namespace(beta=0.1)

    theirs, logits = _policy_logits(setup, batch)
    all_logps = ORPOTrainer.get_batch_logps(logits, labels.clone(), average_log_prob=True)
    losses, c_rew, r_rew, ratio, _ = ORPOTrainer.odds_ratio_loss(ns, *all_logps.chunk(2))
    (-losses.mean()).backward()

    ours, logits = _policy_logits(setup, batch)
    policy = sequence_logps(logits[:, :-1], labels[:, 1:]).halves()
    result = pair_loss(policy, None, LossSettings(loss="orpo", beta=0.1))
    result.losses.mean().backward()

    assert torch.allclose(result.losses, -losses, atol=TOL, rtol=0)
    assert abs(float(orpo_odds_ratio(policy[0].mean, policy[1].mean).mean()) - float(ratio)) < TOL
    assert torch.allclose(result.chosen_rewards, c_rew, atol=TOL, rtol=0)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=TOL, rtol=0), name


def test_label_smoothing_is_the_conservative_form():
    x = torch.tensor([-2.0, 0.0, 3.0])
    eps = 0.25
    want = -(1 - eps) * torch.log(torch.sigmoid(x)) - eps * torch.log(torch.sigmoid(-x))
    assert torch.allclose(smoothed_sigmoid(x, eps), want, atol=1e-6)
    assert torch.allclose(smoothed_sigmoid(x, 0.0), -torch.log(torch.sigmoid(x)), atol=1e-6)
