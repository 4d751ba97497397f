"""The GRPO objective as pure torch functions: group-relative advantages (Shao et al. 2024, DeepSeekMath §4.1.2),
the token-level clipped surrogate with separate low/high clip ranges (DAPO's clip-higher, Yu et al. 2025 §3.1),
the k3 estimate of KL to the reference weighted by `beta` (Schulman 2020, "Approximating KL divergence"; by
default times the ratio, DeepSeek-V3.2's unbiased form), and the three normalisations of the summed token losses: `grpo` (each completion's mean, then the batch mean), `dr_grpo`
(the sum over batch size x max completion tokens, Liu et al. 2025 §3.1: no length bias), `dapo` (the sum over
every completion token of the generation batch). Completions cut off at max tokens can be masked out of the loss.

The arithmetic follows TRL 1.16's GRPOTrainer (`_generate_and_score_completions`, `_compute_loss`): the same
1e-4 in the advantage's denominator and the same metric names, so a run's curves read like TRL's
(tests/unit/train/test_grpo_parity.py checks the loss and gradients against TRL itself)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossType = Literal["grpo", "dr_grpo", "dapo"]
RewardScale = Literal["group", "batch", "none"]
ADVANTAGE_EPS = 1e-4  # TRL's (and DeepSeekMath's reference code's) guard on a group whose rewards are all equal


@dataclass(frozen=True)
class GRPOLossSettings:
    loss_type: LossType = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    max_completion_tokens: int = 256  # dr_grpo's constant denominator
    #: KL times the (differentiable) ratio: the unbiased reverse-KL gradient off-policy (DeepSeek-V3.2, §2.1;
    #: TRL 1.16's default `use_bias_correction_kl`)
    kl_bias_correction: bool = True


@dataclass(frozen=True)
class Advantages:
    """Per completion (B,): the advantage and the std it was scaled by (its group's, the batch's, or unscaled)."""

    values: torch.Tensor
    std: torch.Tensor

    @property
    def frac_zero_std(self) -> float:
        """Share of completions whose group had no spread (no learning signal): TRL's `frac_reward_zero_std`."""
        return float(torch.isclose(self.std, torch.zeros_like(self.std)).float().mean())


def group_advantages(rewards: torch.Tensor, group_size: int, scale: RewardScale = "group") -> Advantages:
    """A_i = (r_i - mean of its group) / (std + 1e-4), the std (unbiased) of its group (`group`), of the whole
    batch (`batch`, Liu et al.'s fix for groups of near-equal rewards) or no division (`none`, Dr. GRPO).
    `rewards` (B,) holds consecutive groups of `group_size` completions of one prompt."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards: expected (B,) with B a multiple of the group size {group_size}, got {rewards.shape}"
        )
    grouped = rewards.view(-1, group_size)
    centred = rewards - grouped.mean(1).repeat_interleave(group_size)
    if scale == "batch":
        std = rewards.std().expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif scale in ("group", "none"):
        std = grouped.std(1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"reward scale {scale!r}: expected group, batch or none")
    values = centred if scale == "none" else centred / (std + ADVANTAGE_EPS)
    return Advantages(values=values, std=std)


def loss_mask(mask: torch.Tensor, truncated: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """The completion tokens that count in the loss: all of each completion's own, none of a truncated one's when
    `mask_truncated` (DAPO's overlong filtering, Yu et al. 2025 §3.4)."""
    mask = mask.float()
    return mask * (~truncated).float()[:, None] if mask_truncated else mask


@dataclass(frozen=True)
class GRPOLoss:
    """The loss to backpropagate and the step's figures under TRL's names (token means over this batch's mask)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of x over the mask's tokens (0 when it has none)."""
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: GRPOLossSettings,
    ref_logps: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
) -> GRPOLoss:
    """The GRPO loss of completions (B, T): `logps` the policy's log-probs of the sampled tokens (with grad),
    `old_logps` those at sampling time (None: the same policy, ratio 1), `advantages` (B,), `mask` (B, T) the
    tokens that count (loss_mask), `ref_logps` the reference's (needed when beta > 0). `num_tokens`: dapo's
    denominator, the generation batch's masked tokens divided by the data-parallel ranks (default: this mask's)."""
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    adv = advantages[:, None]
    clipped = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    metrics: dict[str, float] = {}
    if settings.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference model's log-probs (ref_logps)")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if settings.kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + settings.beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    if settings.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif settings.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * settings.max_completion_tokens)
    elif settings.loss_type == "dapo":
        denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=logps.dtype)
        loss = (per_token * mask).sum() / denom.clamp(min=1.0)
    else:
        raise ValueError(f"loss type {settings.loss_type!r}: expected grpo, dr_grpo or dapo")
    low = ((ratio < 1 - settings.epsilon_low) & (adv < 0)).float().detach()
    high = ((ratio > 1 + settings.epsilon_high) & (adv > 0)).float().detach()
    metrics["clip_ratio/low_mean"] = masked_mean(low, mask)
    metrics["clip_ratio/high_mean"] = masked_mean(high, mask)
    metrics["clip_ratio/region_mean"] = masked_mean(torch.maximum(low, high), mask)
    has = mask.sum(-1) > 0  # TRL's masked_seq_mean with nanmin / nanmax: sequences with no loss token left out
    per_seq = [(x * mask).sum(-1)[has] / mask.sum(-1)[has] for x in (low, high)]
    metrics["clip_ratio/low_min"] = float(per_seq[0].min()) if bool(has.any()) else 0.0
    metrics["clip_ratio/high_max"] = float(per_seq[1].max()) if bool(has.any()) else 0.0
    return GRPOLoss(loss=loss, metrics=metrics)


def rollout_metrics(
    rewards_per_fn: torch.Tensor,
    names: tuple[str, ...],
    weights: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    advantages: Advantages,
) -> dict[str, float]:
    """The generation side's figures with TRL's names: `reward` and `reward_std` (the weighted total),
    `rewards/<fn>/mean` and `/std`, `completions/mean_length` (min, max; and of the completions that ended, the
    `_terminated_length`s: 0 when none did), `completions/clipped_ratio` (share truncated), `frac_reward_zero_std`."""
    total = (rewards_per_fn * weights[None, :]).sum(-1)
    ended = lengths[~truncated].float() if bool((~truncated).any()) else torch.zeros(1)
    out = {
        "reward": float(total.mean()),
        "reward_std": float(total.std()) if total.numel() > 1 else 0.0,
        "completions/mean_length": float(lengths.float().mean()),
        "completions/min_length": float(lengths.float().min()),
        "completions/max_length": float(lengths.float().max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
        "completions/mean_terminated_length": float(ended.mean()),
        "completions/min_terminated_length": float(ended.min()),
        "completions/max_terminated_length": float(ended.max()),
        "frac_reward_zero_std": advantages.frac_zero_std,
    }
    for i, name in enumerate(names):
        col = rewards_per_fn[:, i]
        out[f"rewards/{name}/mean"] = float(col.mean())
        out[f"rewards/{name}/std"] = float(col.std()) if col.numel() > 1 else 0.0
    return out
