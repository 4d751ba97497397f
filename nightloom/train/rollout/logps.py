"""The policy's (or the reference's) log-probs of sampled completions, through the model's ordinary training
forward: what the GRPO ratio and KL compare with the log-probs kept at sampling.

A row is [left padding | prompt | completion | right padding]; the padding runs are documents of their own
(`doc_ids` 0, 1 for the sequence, 2 after it), so the model's block-causal attention keeps them out of the
sequence's attention and its per-document positions start the prompt at 0: the positions generation used."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nightloom.train.rollout.generate import Rollout


@dataclass(frozen=True)
class RolloutBatch:
    """Prompts (B, P) left-padded and their completions (B, N) as one (B, P + N) forward's inputs."""

    ids: torch.Tensor
    doc_ids: torch.Tensor
    prompt_len: int
    completion_mask: torch.Tensor  # (B, N) each row's own completion tokens


def rollout_batch(prompt_ids: torch.Tensor, pad: torch.Tensor, rollout: Rollout) -> RolloutBatch:
    """Join left-padded prompts (B, P) with `pad` (B,) pad counts and their rollout."""
    b, p = prompt_ids.shape
    n = rollout.tokens.shape[1]
    ids = torch.cat([prompt_ids.to(rollout.tokens.device), rollout.tokens], 1)
    t = torch.arange(p + n, device=ids.device)[None, :].expand(b, -1)
    pad = pad.to(ids.device)
    end = p + rollout.lengths.to(ids.device)
    doc = torch.ones_like(ids)
    doc = torch.where(t < pad[:, None], 0, doc)
    doc = torch.where(t >= end[:, None], 2, doc)
    return RolloutBatch(ids=ids, doc_ids=doc, prompt_len=p, completion_mask=rollout.mask)


def completion_logps(model: nn.Module, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """(B, N) log-probs of the completion tokens under `model` (logits / temperature, TRL's convention; 0 outside
    the completions). Differentiable: the training step's current-policy term."""
    return completion_logps_and_entropy(model, batch, temperature)[0]


def completion_logps_and_entropy(
    model: nn.Module, batch: RolloutBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """completion_logps and, from the same forward, each completion position's entropy (nats, detached; 0 outside
    the completions) of the policy's distribution of logits / temperature: TRL's `entropy` figure per token
    (trl.trainer.utils.entropy_from_logits)."""
    logits = model(batch.ids, doc_ids=batch.doc_ids)[:, batch.prompt_len - 1 : -1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch.ids[:, batch.prompt_len :]
    logp_all = logits.log_softmax(-1)
    keep = batch.completion_mask.to(logp_all.dtype)
    logps = logp_all.gather(-1, targets[..., None])[..., 0]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps * keep, entropy * keep
