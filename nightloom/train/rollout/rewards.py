"""Scoring a batch of completions with resolved reward functions (nightloom/rewards/resolve.py): every function's
scores checked (as many as completions, each a finite number) and their weighted total.

A function that returns the wrong number of scores or a score that is not a finite number, or raises, fails the
step naming it (RewardError): never silently scored 0."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nightloom.rewards.resolve import Reward, RewardError, RewardRef, load_reward, load_rewards

__all__ = ["Reward", "RewardError", "RewardRef", "RewardScores", "load_reward", "load_rewards", "score"]


@dataclass(frozen=True)
class RewardScores:
    """Scores of B completions: `per_fn` (B, F) in the order of the rewards, `total` (B,) their weighted sum."""

    names: tuple[str, ...]
    per_fn: torch.Tensor
    total: torch.Tensor


def _checked(reward: Reward, values: object, n: int) -> list[float]:
    who = f"reward {reward.ref.fn}"
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise RewardError(f"{who} returned {type(values).__name__}, not a list of {n} floats")
    if len(values) != n:
        raise RewardError(f"{who} returned {len(values)} scores for {n} completions")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise RewardError(f"{who}: score {i} is {v!r}, not a finite number")
        out.append(float(v))
    return out


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[str],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence] | None = None,
) -> RewardScores:
    """Score B completions with every reward; `columns` are the dataset's other fields, one entry per completion."""
    n = len(completions)
    row = {**(columns or {}), "completion_ids": list(completion_ids)}
    per_fn = []
    for reward in rewards:
        try:
            values = reward.fn(list(prompts), list(completions), **row)
        except RewardError:
            raise
        except Exception as e:  # the user's function failed: the step fails naming it
            raise RewardError(f"reward {reward.ref.fn} raised {type(e).__name__}: {e}") from e
        per_fn.append(_checked(reward, values, n))
    table = torch.tensor(per_fn, dtype=torch.float32).T.reshape(n, len(rewards))
    weights = torch.tensor([r.ref.weight for r in rewards], dtype=torch.float32)
    return RewardScores(names=tuple(r.ref.name for r in rewards), per_fn=table, total=(table * weights).sum(-1))
