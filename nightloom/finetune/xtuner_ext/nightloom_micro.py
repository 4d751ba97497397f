"""XTuner's DDP wrapper with gradient accumulation by micro-batches, and the loss of the whole step in the log.

Runs inside the XTuner env (node_wrapper.py puts this folder on sys.path; the rendered config names the class
as "nightloom_micro.MicroBatchDDP"), so it imports only torch and mmengine, never nightloom.

Why: after recovery on fewer nodes (2 ranks -> 1), a rank must do the work of the ranks that left without
changing what a step computes. mmengine's own `accumulative_counts` counts micro-batches as iterations, which
renumbers steps, stretches the LR schedule and shifts what a resumed loop skips; here one iteration stays one
optimizer step. The rank's batch (global_batch / world ranks) is cut into `micro_batches` chunks, each chunk
the rows a rank of the wider layout held (rows a, a+k, a+2k...: mmengine's DefaultSampler deals a step's
samples out round-robin), trimmed of the padding its rows do not need, so each forward is that rank's forward;
the chunk losses (XTuner's token means) are averaged and DDP averages the ranks: the gradient of the wider
layout's step, one all-reduce per step (no_sync on all chunks but the last).

The logged losses are the mean over every rank and chunk (one small all-reduce), so the loss of a step reads the
same whatever the layout; mmengine on its own logs rank 0's micro-batch.

Exact (up to float summation order) for fp32 without dropout: with dropout each chunk draws other masks than the
rank it stands for, and under AMP the sums run in another order (close, not equal). `MicroBatchSampler` pads an
epoch as the wider layout did, so an epoch's last step matches too.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from mmengine.dataset import DefaultSampler
from mmengine.model import MMDistributedDataParallel


class MicroBatchSampler(DefaultSampler):
    """mmengine's DefaultSampler, its epoch padded (round_up) to a multiple of `pad_to` ranks, not of this run's:
    `pad_to` = ranks x micro_batches, the world the step was planned for. Fewer ranks then see the wider
    layout's padded epoch too, so its last step holds the same samples (DefaultSampler alone pads to the
    current world size: the wider layout repeats samples where the narrower one has a short batch)."""

    def __init__(self, dataset, shuffle: bool = True, seed: int | None = None, round_up: bool = True, pad_to: int = 0):
        super().__init__(dataset, shuffle=shuffle, seed=seed, round_up=round_up)
        if round_up and pad_to:
            if pad_to % self.world_size:
                raise ValueError(f"nightloom: pad_to {pad_to} is not a multiple of the world size {self.world_size}")
            self.total_size = math.ceil(len(self.dataset) / pad_to) * pad_to
            self.num_samples = self.total_size // self.world_size


def split_rows(data: dict, k: int) -> list[dict]:
    """`data` (xtuner's default_collate_fn output: {"data": {name: [B, ...] tensor}, "data_samples": ...}) as
    chunks of rows a::k, each trimmed to its own longest row (attention_mask), as that row group alone would
    have been collated. A short last batch of an epoch (fewer than k rows) gives one chunk per row."""
    inner = data["data"]
    rows = next(v.shape[0] for v in inner.values() if torch.is_tensor(v))
    mask = inner.get("attention_mask")
    chunks = []
    for a in range(min(k, rows)):
        width = seq = None
        if torch.is_tensor(mask) and mask.dim() == 2:
            seq = mask.shape[1]
            width = int(mask[a::k].sum(dim=1).max())  # right padding (xtuner's collate): trailing columns
        part = {n: _rows(v, a, k, rows, width, seq) for n, v in inner.items()}
        chunks.append({**data, "data": part})
    return chunks


def _rows(v, a: int, k: int, rows: int, width: int | None, seq: int | None):
    """Rows a::k of a batch tensor (its first `width` of `seq` columns when it is [B, seq, ...]); anything else
    unchanged."""
    if not (torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == rows):
        return v
    v = v[a::k]
    if width is not None and v.dim() >= 2 and v.shape[1] == seq:
        v = v[:, :width]
    return v.contiguous()


def mean_over_ranks(log_vars: dict) -> dict:
    """Each logged value averaged over the ranks (a no-op on one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return log_vars
    names = list(log_vars)
    flat = torch.stack([torch.as_tensor(log_vars[n], dtype=torch.float64).detach().cpu().reshape(()) for n in names])
    if dist.get_backend() == "nccl":
        flat = flat.cuda()
    dist.all_reduce(flat)
    flat = (flat / dist.get_world_size()).cpu()
    return {n: flat[i].to(torch.float32) for i, n in enumerate(names)}


class MicroBatchDDP(MMDistributedDataParallel):
    """MMDistributedDataParallel whose train_step runs `micro_batches` forward/backward passes per step."""

    def __init__(self, module, micro_batches: int = 1, **kwargs):
        super().__init__(module=module, **kwargs)
        if micro_batches < 1:
            raise ValueError(f"nightloom: micro_batches must be >= 1, not {micro_batches}")
        self.micro_batches = micro_batches

    def train_step(self, data, optim_wrapper):
        chunks = split_rows(data, self.micro_batches) if self.micro_batches > 1 else [data]
        k = len(chunks)
        sums: dict = {}
        for a, chunk in enumerate(chunks):
            # gradients are summed locally until the last chunk, whose backward all-reduces them
            sync = contextlib.nullcontext() if a == k - 1 else self.no_sync()
            with sync:
                with optim_wrapper.optim_context(self):
                    chunk = self.module.data_preprocessor(chunk, training=True)
                    losses = self._run_forward(chunk, mode="loss")
                parsed, log_vars = self.module.parse_losses(losses)
                optim_wrapper.backward(parsed / k if k > 1 else parsed)
            for n, v in log_vars.items():
                sums[n] = sums.get(n, 0.0) + torch.as_tensor(v).detach().to(torch.float64)
        optim_wrapper.step()
        optim_wrapper.zero_grad()
        return mean_over_ranks({n: (v / k).to(torch.float32) for n, v in sums.items()})
