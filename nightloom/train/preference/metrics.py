"""A step's preference figures under TRL's names (rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected), summed over micro-batches and ranks, then averaged per pair."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nightloom.train.preference.logps import SequenceLogps
from nightloom.train.preference.losses import PairLoss

NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass
class PairSums:
    """Sums over pairs of what TRL averages (and the loss), so micro-batches and ranks add up exactly."""

    pairs: float = 0.0
    loss: float = 0.0
    chosen_rewards: float = 0.0
    rejected_rewards: float = 0.0
    correct: float = 0.0
    chosen_logps: float = 0.0
    rejected_logps: float = 0.0

    def add(self, result: PairLoss, policy: tuple[SequenceLogps, SequenceLogps], logps_mean: bool) -> None:
        """Add one micro-batch: `logps_mean` logs average log-probs (simpo, orpo: TRL's CPO/ORPO do), else sums."""
        c, r = policy
        pick = (lambda s: s.mean) if logps_mean else (lambda s: s.total)
        self.pairs += float(result.losses.numel())
        self.loss += float(result.losses.detach().sum())
        self.chosen_rewards += float(result.chosen_rewards.sum())
        self.rejected_rewards += float(result.rejected_rewards.sum())
        self.correct += float((result.chosen_rewards > result.rejected_rewards).float().sum())
        self.chosen_logps += float(pick(c).detach().sum())
        self.rejected_logps += float(pick(r).detach().sum())

    def as_tensor(self) -> torch.Tensor:
        """The sums as one fp64 vector (to all-reduce over ranks)."""
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> PairSums:
        return cls(*(float(v) for v in t.tolist()))

    def figures(self) -> dict[str, float]:
        """The per-pair means under TRL's names, plus `loss`."""
        n = max(self.pairs, 1.0)
        return {
            "loss": self.loss / n,
            "rewards/chosen": self.chosen_rewards / n,
            "rewards/rejected": self.rejected_rewards / n,
            "rewards/accuracies": self.correct / n,
            "rewards/margins": (self.chosen_rewards - self.rejected_rewards) / n,
            "logps/chosen": self.chosen_logps / n,
            "logps/rejected": self.rejected_logps / n,
        }
