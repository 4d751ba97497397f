"""Native generation: a batch of prompts -> completions with the sampled tokens' log-probs, over the training
model itself (KV cache: kv_cache.py; token choice: sampling.py).

Prompts come as token lists, or as a padded (B, T) batch with its attention mask, padded on either side: both are
laid out left-padded, which lets every row's next token take the same cache slot. A row finishes at an EOS id,
at the token that completes a stop string (decoded with the caller's `decode`), or after `max_new_tokens`
(truncated: `Rollout.truncated`, the rows GRPO may mask). Under FSDP2 the model's shards are gathered once for
the whole generation (`gathered`) and freed after."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nightloom.train.rollout.kv_cache import KVCache, cached_logits, check_cacheable
from nightloom.train.rollout.sampling import GroupGenerators, SamplingParams, next_tokens


@dataclass(frozen=True)
class Rollout:
    """Completions of one batch: `tokens` (B, N) right-padded with `pad_id` after each row's end, `logprobs` (B, N)
    of the sampled tokens (0 past the end), `mask` (B, N) True on a row's own tokens (EOS / stop token included),
    `truncated` (B,) rows that reached max_new_tokens without ending."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)

    def completion_ids(self) -> list[list[int]]:
        """Each row's own tokens, as lists."""
        return [row[m].tolist() for row, m in zip(self.tokens, self.mask, strict=True)]


def left_padded(
    prompts: Sequence[Sequence[int]] | torch.Tensor, attention_mask: torch.Tensor | None, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T) left-padded with pad_id, pad counts (B,)) from token lists or a padded batch and its mask
    (left or right padding; a mask with holes inside a row is refused)."""
    if isinstance(prompts, torch.Tensor):
        if attention_mask is None:
            attention_mask = torch.ones_like(prompts, dtype=torch.bool)
        rows = []
        for i, (row, m) in enumerate(zip(prompts, attention_mask.bool(), strict=True)):
            idx = m.nonzero()[:, 0]
            if len(idx) and int(idx[-1] - idx[0] + 1) != len(idx):
                raise ValueError(f"prompt row {i}: its attention mask has holes (padding inside the prompt)")
            rows.append(row[m].tolist())
        prompts = rows
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
    return ids, torch.tensor([width - len(p) for p in prompts], dtype=torch.long)


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Under FSDP2, every sharded module unsharded (all-gathered) for the block, resharded after; else as is."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.unshard()
    try:
        yield model
    finally:
        for m in sharded:
            m.reshard()


class _StopStrings:
    """Which rows' completions now end with (contain, in their last tokens) a stop string."""

    def __init__(self, stop: tuple[str, ...], decode: Callable[[list[int]], str] | None):
        if stop and decode is None:
            raise ValueError("stop strings need a decode function (the tokenizer's)")
        self.stop, self.decode = stop, decode
        # a stop string of n characters spans at most n tokens, plus a few that decode to partial characters
        self.tail = max((len(s) for s in stop), default=0) + 4

    def hit(self, rows: list[list[int]]) -> list[bool]:
        if not self.stop:
            return [False] * len(rows)
        return [any(s in self.decode(r[-self.tail :]) for s in self.stop) for r in rows]


@torch.no_grad()  # not inference_mode: FSDP2 gathers into buffers the training forward reuses
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    params: SamplingParams,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator | GroupGenerators | None = None,
    attention_mask: torch.Tensor | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> Rollout:
    """Sample completions of `prompts` from `model` (a native Transformer, FSDP2-sharded or not)."""
    stops = _StopStrings(params.stop, decode)
    device = next(model.parameters()).device
    ids, pad = left_padded(prompts, attention_mask, pad_id)
    ids, pad = ids.to(device), pad.to(device)
    b, n = ids.shape[0], params.max_new_tokens
    if isinstance(generator, GroupGenerators) and len(generator.generators) * generator.size != b:
        raise ValueError(
            f"{len(generator.generators)} group generators of {generator.size} rows each for {b} prompt rows"
        )
    tokens = torch.full((b, n), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((b, n), dtype=torch.float32, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    eos = torch.as_tensor(list(eos_ids), dtype=torch.long, device=device)
    cache = KVCache(pad=pad, max_len=ids.shape[1] + n)
    with gathered(model):
        check_cacheable(model)
        logits = cached_logits(model, ids, cache)
        for step in range(n):
            tok, lp = next_tokens(logits, params, generator)
            tok = torch.where(done, pad_id, tok)
            tokens[:, step] = tok
            logprobs[:, step] = torch.where(done, 0.0, lp)
            lengths += (~done).long()
            ended = torch.isin(tok, eos)
            if stops.stop:
                live = (~done).nonzero()[:, 0].tolist()
                hits = stops.hit([tokens[i, : step + 1].tolist() for i in live])
                ended[[i for i, h in zip(live, hits, strict=True) if h]] = True
            done = done | ended
            if bool(done.all()) or step == n - 1:
                break
            logits = cached_logits(model, tok[:, None], cache)
    mask = torch.arange(n, device=device)[None, :] < lengths[:, None]
    return Rollout(tokens=tokens, logprobs=logprobs, mask=mask, truncated=~done)
