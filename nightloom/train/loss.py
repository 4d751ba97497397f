"""Cross-entropy fused with the output head, chunk by chunk: the (tokens, vocab) logits of a whole micro-batch
never exist at once, in forward or backward.

The final hidden states (N, d) are split into chunks of `chunk` tokens; each chunk runs head matmul -> (softcap)
-> fp32 cross-entropy sum under torch.utils.checkpoint (non-reentrant), so forward keeps only the chunk's loss and
backward recomputes one chunk's logits at a time (the gradient of the head weight accumulates over chunks). At
vocab 128k and 8k tokens per micro-batch the plain loss holds 4 GiB of fp32 logits (and as much for their
softmax); chunked, 4 · chunk · vocab bytes (512 MiB at the default 1,024 tokens) plus the head weight's gradient.
The cost is one more head matmul per chunk in backward (the recompute).

The ops per chunk are the plain path's (F.linear, softcap, slice of TP-padded rows, `.float()`, cross_entropy), so
in fp32 the loss equals the plain one up to the order of the sum (tests/unit/train/test_chunked_loss.py: 1e-6).
Used by the trainer when the head is whole on the rank (pp = 1, tp = 1, cp = 1; FSDP2 gathers it for the root's
forward): `nightloom.planner.memory.chunked_ce` is the one rule, and the planner counts the chunk's logits then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nightloom.planner.memory import CE_CHUNK_TOKENS

IGNORE_INDEX = -100  # a target that is not a label (train/data.py's, F.cross_entropy's default)


def _chunk_nll(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, softcap: float | None):
    logits = F.linear(h, weight)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if logits.shape[-1] != vocab:  # rows padded for TP are never predicted
        logits = logits[..., :vocab]
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_nll_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    softcap: float | None = None,
    chunk: int = CE_CHUNK_TOKENS,
) -> torch.Tensor:
    """Sum over label targets (not IGNORE_INDEX) of the next-token NLL of `hidden` (..., d) through the head
    `weight` (rows, d), in fp32, never holding more than `chunk` tokens' logits."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if h.shape[0] != t.shape[0]:
        raise ValueError(f"chunked loss: {h.shape[0]} hidden rows but {t.shape[0]} targets")
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    for hc, tc in zip(torch.split(h, chunk), torch.split(t, chunk)):
        if grad:
            total = total + checkpoint(_chunk_nll, hc, weight, tc, vocab, softcap, use_reentrant=False)
        else:
            total = total + _chunk_nll(hc, weight, tc, vocab, softcap)
    return total


class HeadLoss:
    """The callable Transformer.forward(head_loss=...) takes: (final normed hidden, head weight) -> loss, for one
    micro-batch's targets. `scale` None: the mean NLL over label targets (F.cross_entropy's mean); else the NLL
    sum times `scale` (train.task sft, parallelize.TokenLoss)."""

    def __init__(self, targets: torch.Tensor, vocab: int, softcap: float | None, scale: float | None, chunk: int):
        self.targets, self.vocab, self.softcap, self.scale, self.chunk = targets, vocab, softcap, scale, chunk

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        nll = chunked_nll_sum(hidden, weight, self.targets, self.vocab, self.softcap, self.chunk)
        if self.scale is None:
            return nll / (self.targets != IGNORE_INDEX).sum()
        return nll * self.scale
