"""Choosing the next token: greedy, or temperature / top-k / top-p sampling in transformers' order (its
TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper), from a generator seeded per (step, rank), or from
one generator per prompt group seeded by (seed, step, the group's global index): `GroupGenerators`, whose draws do
not depend on which rank holds a group or what else is in its batch, so 2 data-parallel ranks sample exactly the
completions one process samples, and a resumed run samples the same ones.

The log-prob kept for each sampled token is under the temperature-scaled distribution before top-k/top-p filtering:
what TRL's GRPOTrainer computes for its old and current policies (logits / temperature, log-softmax), so the ratio
of the GRPO loss compares like with like."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled. temperature 0: greedy. top_k 0 and top_p 1: no filtering."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings: a completion ends with the token that completes one

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def rollout_generator(seed: int, step: int, rank: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The sampling RNG of one (seed, step, data-parallel rank): re-created at a step, it draws the same tokens
    (so a run resumed from a checkpoint samples what the first attempt would have). Tensor-parallel peers pass the
    same rank: they must draw the same tokens."""
    digest = hashlib.blake2b(f"{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _seed_of(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


@dataclass(frozen=True)
class GroupGenerators:
    """One generator per prompt group of a batch whose rows are `size` consecutive completions of each group's
    prompt: at every decode step each group draws `size` uniforms from its own generator (the inverse-CDF sample of
    each row), so a row's tokens depend only on its group's seed and its logits, never on the batch around it."""

    generators: tuple[torch.Generator, ...]
    size: int

    def uniform(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """(groups x size,) uniforms in [0, 1), one per row, the next draw of each group's generator."""
        return torch.cat([torch.rand(self.size, generator=g, dtype=torch.float64) for g in self.generators]).to(device)


def group_generators(seed: int, step: int, first: int, groups: int, size: int) -> GroupGenerators:
    """The generators of groups first .. first + groups - 1 (their global indices in the step's prompts, over
    every data-parallel rank) at generation round `step` of a run seeded `seed`."""
    gens = tuple(torch.Generator().manual_seed(_seed_of(f"{seed}/{step}/group{first + i}")) for i in range(groups))
    return GroupGenerators(gens, size)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row (B,) of `probs` (B, V) whose cumulative probability first exceeds u (B,) in [0, 1)
    times the row's total: a sample of the row's distribution; a token of probability 0 is never chosen."""
    cdf = probs.cumsum(-1)
    x = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, x, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
    zero = probs.gather(-1, tokens[:, None])[:, 0] == 0  # x rounded up to the row's total: its last token
    if bool(zero.any()):
        last = (probs > 0).long().cumsum(-1).argmax(-1)  # the first index reaching the row's count
        tokens = torch.where(zero, last, tokens)
    return tokens


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits (B, V) with the tokens outside the top k and outside the top-p nucleus set to -inf (transformers'
    TopKLogitsWarper then TopPLogitsWarper: the nucleus keeps the smallest set whose probability reaches top_p,
    and at least one token)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already reaches top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | GroupGenerators | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,), their log-probs (B,)) from the last position's logits (B, V), in fp32. With GroupGenerators
    every group draws its rows' uniforms (B = groups x size), greedy draws nothing."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    scaled = logits / params.temperature
    probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
    if isinstance(generator, GroupGenerators):
        tokens = inverse_cdf(probs, generator.uniform(probs.device))
    else:
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, scaled.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]


def group_row_seeds(seed: int, step: int, first: int, groups: int, size: int) -> list[int]:
    """One integer seed per row of groups first .. first + groups - 1 at generation round `step`: for an engine
    that seeds each request itself (vLLM's SamplingParams.seed) rather than drawing from `group_generators`. A
    row's seed depends only on (seed, step, its group's global index, its place in the group), as the groups' RNG."""
    return [
        _seed_of(f"{seed}/{step}/group{first + g}/row{j}") & (2**31 - 1) for g in range(groups) for j in range(size)
    ]
