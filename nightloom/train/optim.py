"""The optimizer, its learning-rate schedule and gradient clipping: what one optimizer step needs besides the model.

The trainer builds one optimizer per model part (`make_optimizer`), sets each step's rate (`set_lr`, from `lr_at`)
and clips before stepping (`grad_norm_and_clip`, the global norm over every shard and pipeline stage).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nightloom.train.parallelize import ModelParts


def lr_at(step: int, base: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to base*min_ratio at the last step."""
    if step < warmup:
        return base * (step + 1) / warmup
    span = max(1, total - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _groups_by_mesh(params) -> list[dict]:
    """One param group per device mesh (plain tensors in their own): a foreach kernel cannot mix a DTensor with a
    plain tensor (TP without SP leaves the norms plain) or DTensors of two meshes; each group steps on its own."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": g} for g in groups.values()]


def make_optimizer(params, t) -> torch.optim.Optimizer:
    """AdamW (betas 0.9, 0.95), or plain SGD (whose update, unlike Adam's, scales with the gradient) per train.optimizer."""
    groups = _groups_by_mesh(params)
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, weight_decay=t.weight_decay, foreach=True)
    return torch.optim.AdamW(groups, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95), foreach=True)


def set_lr(optims: list[torch.optim.Optimizer], lr: float) -> None:
    """This step's rate in every param group of every optimizer."""
    for o in optims:
        for g in o.param_groups:
            g["lr"] = lr


def step_and_zero(optims: list[torch.optim.Optimizer]) -> None:
    """Apply the update, then drop the gradients (set to None, freeing their memory until the next backward)."""
    for o in optims:
        o.step()
        o.zero_grad(set_to_none=True)


def grad_norm_and_clip(parts: ModelParts, max_norm: float, pp_group) -> torch.Tensor:
    """Global L2 norm over all parts, TP/FSDP shards (DTensor) and pipeline stages; clip in place. A tied
    matrix's second copy (the last pipeline stage's head) is clipped but counted once, as in the whole model."""
    from torch.distributed.tensor import DTensor

    params = [p for m in parts.parts for p in m.parameters() if p.grad is not None]
    copy = parts.tied.weight if parts.tied is not None and parts.tied.is_head_copy else None
    groups: dict[object, list[torch.nn.Parameter]] = {}  # DTensor ops need one mesh per foreach call
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    sq = torch.zeros((), dtype=torch.float32, device=params[0].device if params else None)
    for group in groups.values():
        counted = [p.grad for p in group if p is not copy]
        if not counted:
            continue
        n = torch.nn.utils.get_total_norm(counted, 2.0, foreach=True)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = sq + n.float() ** 2
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
