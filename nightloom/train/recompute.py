"""Cheap ops recomputed in backward instead of saved: what the trainer's blocks keep for backward is what
planner/activations.py counts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint


def recomputed(fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """fn(*args), saving only its (tensor) inputs for backward and running it again there (non-reentrant checkpoint: the
    same ops, so the same gradients); a plain call when no graph is recorded."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
