"""The pairwise preference losses as pure functions of per-sequence log-probs, their defaults as TRL 1.16's.

- sigmoid (DPO, Rafailov et al. 2023, "Direct Preference Optimization", eq. 7): -log σ(β·Δ), Δ = the chosen's
  minus the rejected's log-ratio to the reference; with label smoothing ε the conservative form (Mitchell 2023,
  "A note on DPO with noisy preferences"): -(1-ε)·log σ(β·Δ) - ε·log σ(-β·Δ). TRL 1.16's DPOTrainer has no ε on
  sigmoid (its CPOTrainer has this form); at ε = 0 both are the same.
- ipo (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences", eq. 17):
  (Δ̄ - 1/(2β))², Δ̄ from per-token averaged log-ratios as TRL does (confirmed there with the authors).
- simpo (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward", eq. 6): no
  reference, -log σ(β·(ā_c - ā_r) - γ) on average completion log-probs; TRL's CPOTrainer(loss_type="simpo",
  cpo_alpha=0) with its β = 0.1, γ = 0.5 (simpo_gamma), and ε as for sigmoid.
- orpo (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model", eqs. 4-7): no
  reference, NLL of the chosen completion - β·log σ(log odds(chosen) - log odds(rejected)) on average completion
  log-probs, odds(p) = p/(1-p); β = 0.1 as TRL's ORPOConfig.

Rewards are TRL's: β·(log-ratio) with a reference, β·(log-prob) without (simpo, orpo: averaged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nightloom.train.preference.logps import SequenceLogps

REFERENCE_FREE = ("simpo", "orpo")
LOSSES = ("sigmoid", "ipo", "simpo", "orpo")
LN2 = math.log(2.0)  # the sigmoid DPO loss of a policy equal to its reference


@dataclass(frozen=True)
class LossSettings:
    """What one of LOSSES needs: β, label smoothing ε (sigmoid, simpo) and SimPO's target margin γ."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE


@dataclass(frozen=True)
class PairLoss:
    """One micro-batch's per-pair losses (with autograd) and the detached rewards TRL logs."""

    losses: torch.Tensor  # (pairs,)
    chosen_rewards: torch.Tensor  # (pairs,) detached
    rejected_rewards: torch.Tensor  # (pairs,) detached


def smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1-ε)·log σ(x) - ε·log σ(-x): the (conservative) Bradley-Terry loss of a preference logit x."""
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = loss * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    return loss


def dpo_sigmoid(chosen_ratio: torch.Tensor, rejected_ratio: torch.Tensor, s: LossSettings) -> torch.Tensor:
    """Rafailov et al. 2023 eq. 7 on summed log-ratios (with Mitchell's ε)."""
    return smoothed_sigmoid(s.beta * (chosen_ratio - rejected_ratio), s.label_smoothing)


def ipo(chosen_ratio_mean: torch.Tensor, rejected_ratio_mean: torch.Tensor, s: LossSettings) -> torch.Tensor:
    """Azar et al. 2023 eq. 17 on per-token averaged log-ratios; β is the paper's τ."""
    return (chosen_ratio_mean - rejected_ratio_mean - 1 / (2 * s.beta)) ** 2


def simpo(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, s: LossSettings) -> torch.Tensor:
    """Meng et al. 2024 eq. 6 on average completion log-probs (no reference)."""
    return smoothed_sigmoid(s.beta * (chosen_mean - rejected_mean) - s.simpo_gamma, s.label_smoothing)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (Mächler 2012, "Accurately computing log(1-exp(-|a|))")."""
    return torch.where(x < -LN2, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_odds_ratio(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor) -> torch.Tensor:
    """log σ(log odds ratio) of Hong et al. 2024 eq. 7 from average completion log-probs (a log-likelihood,
    at most 0: the loss subtracts β times it)."""
    c, r = chosen_mean.float(), rejected_mean.float()
    return F.logsigmoid((c - r) - (log1mexp(c) - log1mexp(r)))


def pair_loss(
    policy: tuple[SequenceLogps, SequenceLogps],
    reference: tuple[torch.Tensor, torch.Tensor] | None,
    s: LossSettings,
) -> PairLoss:
    """The per-pair loss of `s.loss` from the policy's (chosen, rejected) log-probs and the reference's summed
    (chosen, rejected) log-probs (None for simpo and orpo). ORPO's NLL term is the caller's (orpo_nll)."""
    chosen, rejected = policy
    if s.needs_reference:
        if reference is None:
            raise ValueError(f"preference loss {s.loss!r} needs the reference's log-probs")
        c_ratio, r_ratio = chosen.total - reference[0], rejected.total - reference[1]
        if s.loss == "sigmoid":
            losses = dpo_sigmoid(c_ratio, r_ratio, s)
        else:
            losses = ipo(c_ratio / chosen.tokens.clamp(min=1.0), r_ratio / rejected.tokens.clamp(min=1.0), s)
        return PairLoss(losses, s.beta * c_ratio.detach(), s.beta * r_ratio.detach())
    if s.loss == "simpo":
        losses = simpo(chosen.mean, rejected.mean, s)
    elif s.loss == "orpo":
        losses = -s.beta * orpo_odds_ratio(chosen.mean, rejected.mean)
    else:
        raise ValueError(f"unknown preference loss {s.loss!r}: one of {', '.join(LOSSES)}")
    return PairLoss(losses, s.beta * chosen.mean.detach(), s.beta * rejected.mean.detach())


def orpo_nll(chosen: SequenceLogps) -> torch.Tensor:
    """ORPO's supervised term: the mean NLL over all chosen completion tokens of the micro-batch."""
    return -chosen.total.sum() / chosen.tokens.sum().clamp(min=1.0)
