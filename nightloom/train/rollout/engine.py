"""The rollout engine seam: what samples GRPO's completions (train.grpo.engine). Both engines take the prompts'
token ids and a `GroupDraw` (which RNG each prompt group samples from) and give back a `Rollout`: each row's
completion ids, the sampled tokens' log-probs, the mask of its own tokens and whether it was truncated.

- `NativeEngine`: generation with a KV cache over the training model itself (generate.py), each group drawing its
  rows' inverse-CDF samples from its own generator (sampling.group_generators): bit-equal across layouts and
  after a resume. Its log-probs are the trainer's own (logits / temperature, before top-k/top-p).
- The vllm engine (vllm_engine.VLLMEngine): vLLM colocated in the rank, the trainer's weights pushed after each
  optimizer step (`sync`). vLLM's sampler is its own (an exponential race, argmax of probs / q with q ~ Exp(1),
  from a per-request seed, `group_row_seeds`), so a vllm run samples other completions than a native one, the
  same for a seed and a layout but not bit-equal to native; its kernels differ in the last bits, so the ratio's
  old log-probs are taken again by the training forward (`recomputes_logps`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from nightloom.train.rollout.generate import Rollout, generate
from nightloom.train.rollout.sampling import GroupGenerators, SamplingParams, group_generators, group_row_seeds


@dataclass(frozen=True)
class GroupDraw:
    """The RNG of a batch whose rows are `size` consecutive completions of each of `groups` prompts: groups
    first .. first + groups - 1 (global indices over every data-parallel rank) at generation round `round` of a
    run seeded `seed`."""

    seed: int
    round: int
    first: int
    groups: int
    size: int

    def generators(self) -> GroupGenerators:
        return group_generators(self.seed, self.round, self.first, self.groups, self.size)

    def row_seeds(self) -> list[int]:
        return group_row_seeds(self.seed, self.round, self.first, self.groups, self.size)


class RolloutEngine(Protocol):
    """Samples completions of prompts (token ids) and keeps the model it samples from in step with training."""

    #: the sampled tokens' log-probs are not the trainer's own: take them again by the training forward
    recomputes_logps: bool

    def sync(self, model: nn.Module, version: int) -> None:
        """Make the engine sample from `model` as it is after `version` optimizer steps (no-op when it does)."""
        ...

    def generate(
        self, model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams, draw: GroupDraw
    ) -> Rollout:
        """Completions of `prompts` (len = draw.groups x draw.size rows), sampled as `params` say."""
        ...


class NativeEngine:
    """Generation inside the training rank, over the training model (FSDP2 shards gathered for it)."""

    recomputes_logps = False

    def __init__(self, eos_ids: Sequence[int], pad_id: int, decode: Callable[[list[int]], str] | None):
        self.eos_ids, self.pad_id, self.decode = list(eos_ids), pad_id, decode

    def sync(self, model: nn.Module, version: int) -> None:
        """Nothing to push: the model it samples from is the training model."""

    def generate(
        self, model: nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams, draw: GroupDraw
    ) -> Rollout:
        was = model.training
        model.eval()
        try:
            return generate(
                model,
                [list(p) for p in prompts],
                params,
                eos_ids=self.eos_ids,
                pad_id=self.pad_id,
                generator=draw.generators(),
                decode=self.decode,
            )
        finally:
            model.train(was)
