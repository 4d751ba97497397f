"""Packed against unpacked SFT (train.pack), one process on CPU, measured in one run (ratios, not absolute claims).

The same conversations (chat-like lengths: log-normal, a prompt then an answer whose ids are labels) train one
epoch each way with the trainer's own pieces: nightloom.train.packing's first-fit rows and document ids, the
native model (block-causal mask with `doc_ids`; the fused causal kernel unpacked), the label-token loss
(parallelize.label_nll_sum over the batch's label tokens) and AdamW, fp32. Repeats are interleaved, medians
compared. Printed: label tokens/s (what training is for: the same labels per epoch both ways) and positions/s
(every id a forward computes, padding included), packed over unpacked, and the rows and conversations per row.
Each step is one micro-batch of rows, so a packed epoch is also fewer optimizer steps: both count in the time.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/sft_packing.py [--convs 96] [--seq-len 512] [--model small]
       [--micro-batch 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

from nightloom.catalog import get_model
from nightloom.train.data import chat_targets
from nightloom.train.model import build_model
from nightloom.train.packing import PackStats, fill_row, first_fit
from nightloom.train.parallelize import IGNORE_INDEX, label_nll_sum


def conversations(n: int, window: int, vocab: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` conversations of chat-like lengths (log-normal, median ~window/5, at most `window`): a prompt (no
    labels) then an answer (labels)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(np.clip(rng.lognormal(np.log(window / 5), 0.7), 8, window))
        prompt = int(rng.integers(2, length - 2))
        labels = np.r_[np.zeros(prompt, np.uint8), np.ones(length - prompt, np.uint8)]
        out.append((rng.integers(1, vocab, length), labels))
    return out


def batches(convs, window: int, mb: int, pack: bool):
    """(inputs, targets, doc ids or None) micro-batches of one epoch: one conversation per row, or packed rows."""
    if pack:
        plan = first_fit(np.array([len(a) for a, _ in convs]), None, window)
        rows = [fill_row([convs[c] for c in plan.row(r)], window, 0) for r in range(plan.rows)]
    else:
        rows = [fill_row([c], window, 0) for c in convs]
    ids, labels, docs = (np.stack([r[i] for r in rows]) for i in range(3))
    x, y = chat_targets(ids, labels)
    d = torch.from_numpy(docs[:, :-1])
    return [(x[i : i + mb], y[i : i + mb], d[i : i + mb] if pack else None) for i in range(0, len(x), mb)], len(rows)


def epoch(model, opt, micro) -> float:
    """Seconds of one epoch of steps (one micro-batch each; the loss is the mean over its label tokens)."""
    t0 = time.perf_counter()
    for x, y, d in micro:
        out = model(x) if d is None else model(x, doc_ids=d)
        loss = label_nll_sum(out, y) / max(int((y != IGNORE_INDEX).sum()), 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--convs", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--model", default="small")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = get_model(args.model)
    window = args.seq_len + 1
    convs = conversations(args.convs, window, shape.vocab)
    runs = {}
    for pack in (False, True):
        micro, rows = batches(convs, window, args.micro_batch, pack)
        model = build_model(shape, args.seq_len, device="cpu")
        model.init_weights(1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        epoch(model, opt, micro[:2])  # warm-up
        runs[pack] = (model, opt, micro, rows)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for pack in (False, True):
            model, opt, micro, _ = runs[pack]
            times[pack].append(epoch(model, opt, micro))
    labels = sum(int(b[1:].sum()) for _, b in convs)
    stats = PackStats(len(convs), runs[True][3], sum(len(a) for a, _ in convs), window)
    med = {p: statistics.median(t) for p, t in times.items()}
    positions = {p: runs[p][3] * args.seq_len for p in (False, True)}
    print(f"model {args.model}, seq_len {args.seq_len}, micro-batch {args.micro_batch}, {len(convs)} conversations")
    print(stats.line())
    for p, name in ((False, "unpacked"), (True, "packed")):
        print(
            f"{name:>8}: {runs[p][3]} rows, epoch {med[p]:.2f} s (median of {args.repeats}), "
            f"{labels / med[p]:,.0f} label tok/s, {positions[p] / med[p]:,.0f} positions/s"
        )
    print(f"label tokens/s, packed / unpacked: {med[False] / med[True]:.2f}x")
    print(
        f"positions/s (padding included), packed / unpacked: {positions[True] / med[True] / (positions[False] / med[False]):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
