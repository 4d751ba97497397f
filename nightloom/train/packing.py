"""Packing for train.task sft (`train.pack`): several whole conversations per row of seq_len + 1 ids.

Rows are filled by greedy first-fit in a shard's (seeded) conversation order: each conversation goes into the
first row that still has room for all of it, else opens a new row. The plan depends only on the lengths, the
order and the row size, so every rank computes the same rows, and a step's rows stay random access by step
number (resuming at step k needs only k). No conversation is split, each appears exactly once per epoch.

Inside a row every conversation gets its own document id (0, 1, ...) and the padding after the last one the
next id, a block of its own: the model's attention is causal AND within one document, positions (RoPE) restart
at 0 per document, and the first id of each conversation is no label (nothing predicts across a boundary).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PackPlan:
    """One shard's rows: row r holds conversations members[starts[r]:starts[r+1]] (shard-local indices, in the
    order they were placed)."""

    members: np.ndarray  # int64 conversation indices, row by row
    starts: np.ndarray  # int64, rows + 1 offsets into members
    ids: int  # conversation ids placed (the real tokens of these rows)

    @property
    def rows(self) -> int:
        return len(self.starts) - 1

    def row(self, r: int) -> np.ndarray:
        return self.members[self.starts[r] : self.starts[r + 1]]


def first_fit(lengths: np.ndarray, order: np.ndarray | None, window: int) -> PackPlan:
    """Greedy first-fit of conversations of `lengths` (taken in `order`, or index order) into rows of `window`
    ids. A max-tree over the rows' free room finds the first row that fits in O(log n); rows not opened yet have
    all their room and come after every open one, so "the first that fits" opens a new row only when no open
    one has room. ValueError names a conversation longer than a row."""
    n = len(lengths)
    seq = np.arange(n) if order is None else np.asarray(order)
    if n and int(np.max(lengths)) > window:
        i = int(np.argmax(lengths))
        raise ValueError(f"conversation {i} has {int(lengths[i])} ids, more than a row of seq_len+1 = {window}")
    size = 1
    while size < max(n, 1):
        size *= 2
    tree = [window] * (2 * size)  # tree[1] is the root; leaves size..2*size-1 are rows 0..size-1
    row_of = np.empty(n, dtype=np.int64)
    used = 0
    lens = [int(x) for x in lengths]
    for c in (int(x) for x in seq):
        need, node = lens[c], 1
        while node < size:  # descend to the leftmost leaf with room >= need
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        r = node - size
        row_of[c] = r
        used = max(used, r + 1)
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    ordered = seq.astype(np.int64)
    rows_in_order = row_of[ordered] if n else row_of
    by_row = np.argsort(rows_in_order, kind="stable")  # keeps placement order within a row
    members = ordered[by_row]
    counts = np.bincount(rows_in_order, minlength=used) if n else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return PackPlan(members, starts, int(np.sum(lengths)))


def fill_row(
    convs: list[tuple[np.ndarray, np.ndarray]], window: int, pad: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, labels, docs) of one packed row of `window`: the conversations back to back (the first id of each
    no label), then `pad` ids (label 0) as one more document."""
    ids = np.full(window, pad, dtype=np.int64)
    labels = np.zeros(window, dtype=np.uint8)
    docs = np.empty(window, dtype=np.int64)
    at = 0
    for d, (a, b) in enumerate(convs):
        ids[at : at + len(a)], labels[at : at + len(a)], docs[at : at + len(a)] = a, b, d
        labels[at] = 0  # its first id continues nothing: the previous conversation's last id predicts no label
        at += len(a)
    docs[at:] = len(convs)
    return ids, labels, docs


@dataclass(frozen=True)
class PackStats:
    """How full packed rows are: conversations per row and the share of ids that are conversation tokens."""

    conversations: int
    rows: int
    ids: int
    window: int

    @property
    def per_row(self) -> float:
        return self.conversations / max(self.rows, 1)

    @property
    def fill(self) -> float:
        return self.ids / max(self.rows * self.window, 1)

    def line(self) -> str:
        unpacked = self.ids / max(self.conversations * self.window, 1)
        return (
            f"packing: {self.conversations} conversations in {self.rows} rows of {self.window} ids, "
            f"{self.per_row:.2f} per row, {self.fill:.1%} of ids are conversation tokens (unpacked {unpacked:.1%})"
        )
