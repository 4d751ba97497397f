"""Unpacked SFT micro-batches (train.task sft, train.pack off): cut to their longest row, optionally grouped by
length, and what a step computed (label tokens, ids, FLOPs).

A row holds one conversation of n ids then padding to seq_len + 1. Its inputs are the first n - 1 ids that predict
anything in it (the last id predicts padding, which is no label), so a micro-batch needs only
max(n) - 1 input positions, not seq_len: the attention is causal, so positions past that change no logit that
counts, and the loss (the sum over label targets, the same label count) is that of the seq_len-wide batch. The
width is rounded up to a multiple the layout needs (`width_multiple`): tp under sequence parallel (the sequence
is sharded over the TP ranks), 8 on a GPU (tensor-core tiles). Layouts whose ranks must agree on one shape keep
seq_len: the pipeline's stages exchange activations through buffers of one fixed shape (pp > 1), and ring
attention shards the RoPE tables with the sequence (cp > 1). TP (and SP) ranks of one DP slice read the same rows,
so they compute the same width; DP ranks each run their own forward, so their widths may differ.

train.group_by_length: each global batch (the same rows as without it, so the step's gradient is unchanged) is
sorted by length and cut into micro-batches of similar rows, which are dealt to the DP ranks in snake order
(0..dp-1, then dp-1..0, ...), so no rank takes all the long ones. It depends only on the lengths: deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nightloom import perf

GPU_MULTIPLE = 8  # a GPU's micro-batch widths: whole tensor-core tiles


def width_multiple(pp: int, cp: int, tp: int, sp: bool, device_type: str) -> int | None:
    """What unpacked micro-batch widths round up to on this layout; None = every one keeps seq_len (pp > 1 or
    cp > 1, see the module docstring)."""
    if pp > 1 or cp > 1:
        return None
    m = GPU_MULTIPLE if device_type == "cuda" else 1
    return int(np.lcm(m, tp)) if sp else m


def batch_width(lengths: np.ndarray, seq_len: int, multiple: int | None) -> int:
    """Input positions of a micro-batch of conversations of `lengths` ids: the longest minus one, rounded up to
    `multiple`, at most seq_len (None: seq_len)."""
    if multiple is None or len(lengths) == 0:
        return seq_len
    need = max(int(np.max(lengths)) - 1, 1)
    return min(-(-need // multiple) * multiple, seq_len)


def length_order(lengths: np.ndarray, micro_batch: int, dp: int) -> np.ndarray:
    """group_by_length: a permutation of one global batch of rows of `lengths` such that DP rank r's contiguous
    slice [r·local, (r+1)·local) holds its micro-batches: rows sorted by length (stable: ties keep their order),
    cut into micro-batches of `micro_batch`, dealt to the ranks in snake order."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    chunks = order.reshape(-1, micro_batch)  # ascending lengths
    ranks: list[list[np.ndarray]] = [[] for _ in range(dp)]
    for i, chunk in enumerate(chunks):
        rnd, pos = divmod(i, dp)
        ranks[pos if rnd % 2 == 0 else dp - 1 - pos].append(chunk)
    return np.concatenate([c for r in ranks for c in r])


def micro_batches(
    inputs: torch.Tensor, targets: torch.Tensor, lengths: np.ndarray, micro_batch: int, multiple: int | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of rows padded to seq_len, cut into micro-batches of `micro_batch` rows, each to its
    own width (batch_width of its rows' `lengths`)."""
    seq_len, out = inputs.shape[1], []
    for i in range(0, len(inputs), micro_batch):
        w = batch_width(lengths[i : i + micro_batch], seq_len, multiple)
        out.append((inputs[i : i + micro_batch, :w], targets[i : i + micro_batch, :w]))
    return out


def trim_to_labels(x: torch.Tensor, y: torch.Tensor, multiple: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An eval micro-batch cut after its last label target (rounded up to `multiple`; None: unchanged): the
    positions after it predict nothing that counts."""
    if multiple is None:
        return x, y
    cols = torch.nonzero((y != -100).any(dim=0))
    need = int(cols[-1]) + 1 if len(cols) else 1
    w = min(-(-need // multiple) * multiple, x.shape[1])
    return x[:, :w], y[:, :w]


class FlopCounter:
    """Model and hardware FLOPs of `rows` rows of `width` positions (PaLM App. B at that width: the attention term
    follows the positions a micro-batch really has); `frozen_base` for LoRA, whose base weights get no gradients."""

    def __init__(self, shape, recompute: str, frozen_base: bool):
        self.shape, self.recompute, self.frozen = shape, recompute, frozen_base
        self._per_token: dict[int, tuple[float, float]] = {}

    def per_token(self, width: int) -> tuple[float, float]:
        """(model, hardware) FLOPs per position at `width` (cached)."""
        if width not in self._per_token:
            f = perf.flops_per_token(self.shape, width, frozen_base=self.frozen)
            h = perf.flops_per_token(self.shape, width, self.recompute, hardware=True, frozen_base=self.frozen)
            self._per_token[width] = (f, h)
        return self._per_token[width]

    def __call__(self, rows: int, width: int) -> tuple[float, float]:
        f, h = self.per_token(width)
        return rows * width * f, rows * width * h


@dataclass(frozen=True)
class StepCounts:
    """One optimizer step, the whole global batch: label tokens (targets the loss is over; pretraining: every
    one), ids computed (rows × width, padding included) and the FLOPs of those (model, hardware)."""

    labels: int
    computed: int
    flops: float
    hflops: float

    @property
    def fill(self) -> float:
        """The share of the computed ids that are label tokens."""
        return self.labels / max(self.computed, 1)


def local_counts(micro: list[tuple[torch.Tensor, torch.Tensor]], flops: FlopCounter, sft: bool) -> list[float]:
    """[label tokens, ids, model FLOPs, hardware FLOPs] of this rank's micro-batches."""
    out = [0.0, 0.0, 0.0, 0.0]
    for x, y in micro:
        f, h = flops(x.shape[0], x.shape[1])
        labels = int((y != -100).sum()) if sft else y.numel()
        for i, v in enumerate((labels, x.numel(), f, h)):
            out[i] += v
    return out


def step_counts(micro, flops: FlopCounter, sft: bool, dp: int, copies: int, device) -> StepCounts:
    """The global batch's StepCounts. sft: this rank's local_counts summed over every rank (one all-reduce) and
    divided by `copies` = tp·pp·cp, the ranks of one DP slice, which all hold that slice's batch. Pretraining:
    every DP rank's share has the same shape and every target is a label, so dp times this rank's, no collective."""
    local = local_counts(micro, flops, sft)
    if not sft:
        labels, computed, f, h = (v * dp for v in local)
    else:
        import torch.distributed as dist

        t = torch.tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        labels, computed, f, h = (float(v) / copies for v in t.tolist())
    return StepCounts(round(labels), round(computed), f, h)


def label_scale(counts: StepCounts, step: int, dp: int, cp: int, micro: int) -> float:
    """train.task sft: dp·cp·m / N, N the label tokens of the whole global batch (see parallelize.TokenLoss).
    RuntimeError when the batch has none."""
    if counts.labels < 1:
        raise RuntimeError(f"step {step}: no label token in the global batch (train.task sft)")
    return dp * cp * micro / counts.labels


def labels_note(tokens_per_s: float, label_tokens_per_s: float) -> str:
    """The step line's ' (labels N)' after tok/s, only where some computed ids are not labels (SFT, padding):
    in pretraining every id is a label and the note would repeat the figure."""
    if round(label_tokens_per_s) >= round(tokens_per_s):
        return ""
    return f" (labels {label_tokens_per_s:,.0f})"
