"""Per-sequence completion log-probs from one forward over chosen and rejected rows concatenated ([chosen;
rejected] along the batch, as TRL's DPOTrainer and the DPO reference code do), for DPO and any later policy-
gradient task (GRPO) that needs the sum or mean of a completion's token log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target that is not a completion token (train/loss.py's, F.cross_entropy's)


@dataclass(frozen=True)
class SequenceLogps:
    """Each row's summed completion log-prob (`total`, with autograd) and its completion token count."""

    total: torch.Tensor  # (rows,) fp32
    tokens: torch.Tensor  # (rows,) fp32, at least 0

    @property
    def mean(self) -> torch.Tensor:
        """The per-token average (IPO, SimPO, ORPO): a row without completion tokens divides by 1."""
        return self.total / self.tokens.clamp(min=1.0)

    def halves(self) -> tuple[SequenceLogps, SequenceLogps]:
        """(chosen, rejected) of a [chosen; rejected] batch."""
        t, n = self.total.chunk(2, dim=0), self.tokens.chunk(2, dim=0)
        return SequenceLogps(t[0], n[0]), SequenceLogps(t[1], n[1])


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at each position of `logits` (rows, T, vocab) in fp32, 0 where the target is IGNORE_INDEX.
    targets[:, t] is what position t predicts (already shifted, as the trainer's (inputs, targets))."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logps: logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    nll = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return -nll.view(targets.shape)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> SequenceLogps:
    """Each row's summed completion log-prob and completion length (targets that are not IGNORE_INDEX)."""
    per_token = token_logps(logits, targets)
    return SequenceLogps(per_token.sum(dim=1), (targets != IGNORE_INDEX).sum(dim=1).float())


def concat_pairs(chosen: torch.Tensor, rejected: torch.Tensor, pad: int) -> torch.Tensor:
    """[chosen; rejected] along the batch, the narrower right-padded with `pad` to the wider's length, so one
    forward scores both halves of every pair."""
    width = max(chosen.shape[1], rejected.shape[1])

    def widen(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, width - x.shape[1]), value=pad)

    return torch.cat([widen(chosen), widen(rejected)], dim=0)
