"""One GRPO step on one data-parallel rank, from the pieces of this package: sample a group of completions per
prompt (the engine, engine.py: native generate.py, or vllm_engine.py), score them (rewards.py), group-relative advantages and the clipped loss (grpo.py), the
policy's log-probs through the training forward (logps.py), backward in micro-batches; and held-out prompts'
mean reward. The trainer keeps the optimizer, checkpoints and reporting (issue 54's remaining wiring).

Each rank holds whole groups (its prompts_per_step / dp prompts, num_generations completions each), so a group's
advantage needs no communication. Each group samples from its own RNG, seeded by (seed, step // iterations, the
group's global index in the step's prompts): the completions do not depend on the layout (2 data-parallel ranks
sample what one process samples) and the batch generated for a step is generated again after a resume. With `iterations` > 1 one generated batch serves that many
optimizer steps, its sampling-time log-probs the ratio's old policy."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from nightloom.spec.grpo import GRPOSpec
from nightloom.train.preference.reference import adapters_disabled
from nightloom.train.rollout.engine import GroupDraw, NativeEngine, RolloutEngine
from nightloom.train.rollout.generate import Rollout, left_padded
from nightloom.train.rollout.grpo import (
    Advantages,
    GRPOLossSettings,
    group_advantages,
    grpo_loss,
    loss_mask,
    masked_mean,
    rollout_metrics,
)
from nightloom.train.rollout.logps import completion_logps, completion_logps_and_entropy, rollout_batch
from nightloom.train.rollout.rewards import Reward, RewardScores, score
from nightloom.train.rollout.sampling import SamplingParams


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, its text (what reward functions see) and the dataset's other columns."""

    ids: list[int]
    text: str
    columns: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GRPOSettings:
    sampling: SamplingParams
    group: int
    loss: GRPOLossSettings
    scale: str = "group"
    mask_truncated: bool = False
    iterations: int = 1
    micro_batch: int = 8  # completions per training forward

    @classmethod
    def from_spec(cls, g: GRPOSpec, micro_batch: int) -> GRPOSettings:
        sampling = SamplingParams(g.max_completion_tokens, g.temperature, g.top_k, g.top_p, tuple(g.stop))
        loss = GRPOLossSettings(g.loss_type, g.epsilon, g.clip_high, g.beta, g.max_completion_tokens)
        return cls(sampling, g.num_generations, loss, g.scale_rewards, g.mask_truncated, g.iterations, micro_batch)


@dataclass(frozen=True)
class ScoredRollout:
    """A generated batch with its scores and advantages, and the seconds generation and scoring took."""

    prompts: list[Prompt]
    prompt_ids: torch.Tensor
    pad: torch.Tensor
    rollout: Rollout
    scores: RewardScores
    advantages: Advantages
    generation_s: float
    scoring_s: float


def reduction(name: str) -> str:
    """How a figure combines over micro-batches and ranks: `min` (clip_ratio/low_min, completions/min_length,
    ...), `max`, or the mean."""
    last = name.rsplit("/", 1)[-1]
    return "min" if last.startswith("min_") or last.endswith("_min") else "max" if (
        last.startswith("max_") or last.endswith("_max")) else "mean"  # fmt: skip


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """Ids -> text for a nightloom.tokenizer.Tokenizer (bytes, Hugging Face `tokenizers`, tiktoken)."""
    if tokenizer.kind == "bytes":
        return lambda ids: bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")
    if hasattr(tokenizer, "tok"):
        return lambda ids: tokenizer.tok.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.enc.decode(ids)


class GRPOStep:
    """GRPO on one rank: `rewards` resolved (rewards.load_rewards), `decode` the tokenizer's."""

    def __init__(
        self,
        settings: GRPOSettings,
        rewards: Sequence[Reward],
        decode: Callable[[list[int]], str],
        eos_ids: Sequence[int],
        pad_id: int,
        seed: int,
        dp_rank: int = 0,
        engine: RolloutEngine | None = None,
    ):
        self.s, self.rewards, self.decode = settings, list(rewards), decode
        self.eos_ids, self.pad_id, self.seed, self.dp_rank = list(eos_ids), pad_id, seed, dp_rank
        self.engine = engine if engine is not None else NativeEngine(eos_ids, pad_id, decode)

    def _sample(self, model: nn.Module, prompts: list[Prompt], draw: GroupDraw) -> Rollout:
        return self.engine.generate(model, [p.ids for p in prompts], self.s.sampling, draw)

    def _score(self, prompts: list[Prompt], rollout: Rollout) -> RewardScores:
        ids = rollout.completion_ids()
        columns = {k: [p.columns[k] for p in prompts] for k in prompts[0].columns} if prompts else {}
        return score(self.rewards, [p.text for p in prompts], [self.decode(c) for c in ids], ids, columns)

    def rollout(self, model: nn.Module, prompts: Sequence[Prompt], step: int) -> ScoredRollout:
        """Sample the group of each prompt (each group's RNG at generation round step // iterations; this rank's
        groups are dp_rank x len(prompts) onwards in the round), score, advantages."""
        expanded = [p for p in prompts for _ in range(self.s.group)]
        t0 = time.perf_counter()
        first = self.dp_rank * len(prompts)
        draw = GroupDraw(self.seed, step // self.s.iterations, first, len(prompts), self.s.group)
        out = self._sample(model, expanded, draw)
        ids, pad = left_padded([p.ids for p in expanded], None, self.pad_id)
        if self.engine.recomputes_logps:  # another engine's log-probs: the ratio's old policy is the trainer's
            out = self._own_logps(model, ids, pad, out)
        t1 = time.perf_counter()
        scores = self._score(expanded, out)
        adv = group_advantages(scores.total, self.s.group, self.s.scale)
        return ScoredRollout(expanded, ids, pad, out, scores, adv, t1 - t0, time.perf_counter() - t1)

    @torch.no_grad()
    def _own_logps(self, model: nn.Module, ids: torch.Tensor, pad: torch.Tensor, out: Rollout) -> Rollout:
        """`out` with its sampled tokens' log-probs taken by the training forward (eval mode, as native generation
        samples), micro-batch by micro-batch."""
        ids, pad = ids.to(out.tokens.device), pad.to(out.tokens.device)
        whole, mb = rollout_batch(ids, pad, out), self.s.micro_batch
        temperature = self.s.sampling.temperature or 1.0
        parts, was = [], model.training
        model.eval()  # as native generation samples: no dropout
        try:
            for start in range(0, ids.shape[0], mb):
                rows = slice(start, start + mb)
                part = type(whole)(whole.ids[rows], whole.doc_ids[rows], whole.prompt_len, whole.completion_mask[rows])
                parts.append(completion_logps(model, part, temperature).float())
        finally:
            model.train(was)
        return Rollout(out.tokens, torch.cat(parts), out.mask, out.truncated)

    def train(
        self, model: nn.Module, batch: ScoredRollout, num_tokens: float | None = None, sync: Callable | None = None
    ) -> tuple[float, dict[str, float]]:
        """Forward and backward of this rank's completions in micro-batches: (its loss, the step's figures; the
        loss's are means over this rank's loss tokens, `loss_tokens` their count).
        `num_tokens`: dapo's denominator over every rank (default this rank's); `sync(last)` is called before each
        micro-batch's backward (FSDP2's set_requires_gradient_sync)."""
        r = batch.rollout
        mask = loss_mask(r.mask, r.truncated, self.s.mask_truncated)
        n, mb = mask.shape[0], self.s.micro_batch
        denom = float(mask.sum()) if num_tokens is None else num_tokens
        whole = rollout_batch(batch.prompt_ids, batch.pad, r)
        total, figures = 0.0, {}
        temperature = self.s.sampling.temperature or 1.0
        for start in range(0, n, mb):
            rows = slice(start, min(start + mb, n))
            part = type(whole)(whole.ids[rows], whole.doc_ids[rows], whole.prompt_len, whole.completion_mask[rows])
            ref = None
            if self.s.loss.beta != 0.0:  # the KL's reference: the base with the LoRA adapters off (no second copy)
                with torch.no_grad(), adapters_disabled(model):
                    ref = completion_logps(model, part, temperature)
            logps, entropy = completion_logps_and_entropy(model, part, temperature)
            out = grpo_loss(logps, r.logprobs[rows], batch.advantages.values[rows], mask[rows], self.s.loss,
                            ref_logps=ref, num_tokens=denom)  # fmt: skip
            share = (rows.stop - rows.start) / n if self.s.loss.loss_type != "dapo" else 1.0
            if sync is not None:
                sync(rows.stop == n)
            (out.loss * share).backward()
            total += float(out.loss.detach()) * share
            share_tokens = float(mask[rows].sum()) / max(float(mask.sum()), 1.0)
            ours = out.metrics | {"entropy": masked_mean(entropy, mask[rows])}  # TRL's: over the loss's tokens
            for k, v in ours.items():  # token means (kl, entropy, clip ratios) weighted by tokens; min or max
                how, seen = reduction(k), figures.get(k)
                if how == "mean":
                    figures[k] = (seen or 0.0) + v * share_tokens
                else:
                    figures[k] = v if seen is None else min(seen, v) if how == "min" else max(seen, v)
        weights = torch.tensor([w.ref.weight for w in self.rewards])
        figures |= rollout_metrics(batch.scores.per_fn, batch.scores.names, weights, r.lengths, r.truncated,
                                   batch.advantages)  # fmt: skip
        figures["loss_tokens"] = float(mask.sum())
        return total, figures

    @torch.no_grad()
    def evaluate(self, model: nn.Module, prompts: Sequence[Prompt]) -> dict[str, float]:
        """Held-out prompts, one sampled completion each from a fixed RNG: the mean reward, its std and standard
        error (what a gain is judged against). Each prompt's RNG is fixed: the same figures on any rank and layout."""
        out = self._sample(model, list(prompts), GroupDraw(self.seed + 1, 0, 0, len(prompts), 1))
        total = self._score(list(prompts), out).total
        std = float(total.std()) if total.numel() > 1 else 0.0
        return {"reward": float(total.mean()), "reward_std": std, "reward_se": std / max(total.numel(), 1) ** 0.5}
