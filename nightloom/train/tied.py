"""Tied embeddings under every layout: one parameter under TP, two identical copies under PP.

TP: parallelize_module gives the embedding and the head a DTensor each; `retie` makes the head use the embedding's
(both vocab-sharded, Shard(0) on the tp mesh), so one parameter takes both gradients. PP: the first stage holds
the embedding and the last the head, each a copy of the one matrix (Megatron's embedding group): `TiedCopies`
starts the last stage's copy from the first's and sums their gradients every step before clipping, so with the
same optimizer state both copies take the same update (`LocalTiedCopies` where one rank holds both: zbv). Checkpoints store the matrix once (train/checkpoint.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

#: the tied matrix's names: the embedding's is the one a checkpoint stores, the head's is the last stage's copy
EMBED_NAME, HEAD_NAME = "tok_embeddings.weight", "output.weight"


def retie(model: nn.Module) -> None:
    """Make the head use the embedding's parameter again after TP replaced both (same DTensor placements)."""
    if not model.shape.tied_embeddings or model.tok_embeddings is None or model.output is None:
        return
    emb, head = model.tok_embeddings.weight, model.output.weight
    if getattr(emb, "placements", None) != getattr(head, "placements", None):
        raise RuntimeError(
            f"tied embeddings: embedding placements {getattr(emb, 'placements', None)} differ from the head's "
            f"{getattr(head, 'placements', None)}"
        )
    model.output.weight = emb


def head_only(model: nn.Module) -> bool:
    """True on a tied model's last pipeline stage: it holds the head's copy of the embedding, not the embedding."""
    return bool(model.shape.tied_embeddings and model.tok_embeddings is None and model.output is not None)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard (a view of a DTensor's local tensor) or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class TiedCopies:
    """This rank's copy of a tied matrix split over pipeline stages, and the group of the two ranks holding it
    (the first and the last stage at this rank's dp, cp and tp coordinates)."""

    group: object
    first_rank: int  # global rank of the first stage's copy (the one the last stage starts from)
    weight: nn.Parameter
    is_head_copy: bool  # the last stage's copy: its gradient is the same sum, so the grad norm counts it once

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Collective (pair): the last stage's copy takes the first stage's values (after init or a weight load)."""
        dist.broadcast(_local(self.weight), src=self.first_rank, group=self.group)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Collective (pair): both copies' gradients become their sum, as the full model's one gradient is."""
        w, g = self.weight, self.weight.grad
        if g is None:
            g = torch.zeros_like(w)
        elif getattr(g, "placements", None) != getattr(w, "placements", None):
            g = g.redistribute(w.device_mesh, w.placements)  # TP's embedding gradient comes back replicated
        dist.all_reduce(_local(g), group=self.group)
        w.grad = g


@dataclass
class LocalTiedCopies:
    """Both copies of a tied matrix on this rank (the V-shaped zbv schedule puts the first and the last chunk on
    pp rank 0): the same two steps as TiedCopies, without a collective."""

    embed: nn.Parameter
    weight: nn.Parameter  # the head's copy (the optimizer counts its gradient, the same sum, once)
    is_head_copy: bool = True

    @torch.no_grad()
    def sync_weights(self) -> None:
        """The head's copy takes the embedding's values (after init or a weight load)."""
        _local(self.weight).copy_(_local(self.embed))

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Both copies' gradients become their sum (two tensors: clipping scales each in place)."""
        grads = [w.grad if w.grad is not None else torch.zeros_like(w) for w in (self.embed, self.weight)]
        total = grads[0] + grads[1]
        self.embed.grad, self.weight.grad = total, total.clone()


def tied_copies(
    shape, parts: list[nn.Module], stage_ids: list[int], n_stages: int, mesh, v_shape: bool = False
) -> TiedCopies | LocalTiedCopies | None:
    """Collective (every rank): the pair groups of a tied model split over pp > 1 stages; this rank's copy, or None
    (untied, one stage, or a middle stage). pp = 2: the pp group is the pair; else one group per pair of ranks.
    `v_shape` (zbv): the first and the last chunk are both on pp rank 0, which ties them locally."""
    if not shape.tied_embeddings or n_stages == 1 or mesh["pp"].size() == 1:
        return None
    if v_shape:
        if 0 not in stage_ids:
            return None
        embed = parts[stage_ids.index(0)].tok_embeddings.weight
        return LocalTiedCopies(embed, parts[stage_ids.index(n_stages - 1)].output.weight)
    ranks = mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) global ranks
    pairs = [list(p) for p in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist())]
    if len(ranks) == 2:
        group = mesh["pp"].get_group()
    else:
        group, _ = dist.new_subgroups_by_enumeration(pairs)
    me = dist.get_rank()
    pair = next((p for p in pairs if me in p), None)
    if pair is None:
        return None
    if 0 in stage_ids:
        weight, is_head = parts[stage_ids.index(0)].tok_embeddings.weight, False
    else:
        weight, is_head = parts[stage_ids.index(n_stages - 1)].output.weight, True
    return TiedCopies(group, pair[0], weight, is_head)
