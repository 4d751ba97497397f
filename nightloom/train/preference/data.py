"""train.task dpo's data: preference pairs from the shards (each document chosen then rejected, nightloom/
chat_pairs.py) as [chosen; rejected] micro-batches of (inputs, targets), in a seeded order per shard like SFT's
conversation rows, and the held-out pairs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nightloom.chat_pairs import split_pair
from nightloom.storage import S3Config
from nightloom.train.data import (
    DataError,
    ShardCache,
    base_uri,
    load_chat_shard,
    open_training_manifest,
    shard_order,
)
from nightloom.train.preference.logps import IGNORE_INDEX


@dataclass(frozen=True)
class PairBatch:
    """Pairs as one forward's rows: inputs and targets (2n, width), chosen rows first, then their rejected."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def pairs(self) -> int:
        return self.inputs.shape[0] // 2

    @property
    def label_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


def pair_batch(docs: list[tuple[np.ndarray, np.ndarray]], pad: int, multiple: int = 1) -> PairBatch:
    """Stored pair documents (ids, 0/1 labels) as a PairBatch cut to its longest sequence, its input width rounded
    up to `multiple` (sft_batch.width_multiple: tp under sequence parallel): targets[t] = ids[t+1] where that id is
    a completion label, else IGNORE_INDEX; padding `pad` ids are never labels."""
    seqs = []
    for ids, labels in docs:
        k = split_pair(ids, labels)
        seqs.append((ids[:k], labels[:k], ids[k:], labels[k:]))
    rows = [(s[0], s[1]) for s in seqs] + [(s[2], s[3]) for s in seqs]
    width = -(-(max(len(ids) for ids, _ in rows) - 1) // multiple) * multiple + 1
    ids_out = np.full((len(rows), width), pad, dtype=np.int64)
    lab_out = np.zeros((len(rows), width), dtype=bool)
    for j, (ids, labels) in enumerate(rows):
        ids_out[j, : len(ids)], lab_out[j, : len(ids)] = ids, labels.astype(bool)
    ids_t, lab_t = torch.from_numpy(ids_out), torch.from_numpy(lab_out)
    return PairBatch(ids_t[:, :-1], torch.where(lab_t[:, 1:], ids_t[:, 1:], IGNORE_INDEX))


class PairRows:
    """Random access to the global stream of pairs (mod the total), each shard in its seeded order; a few shards
    are kept loaded."""

    def __init__(self, manifest: str, seed: int | None, tokenizer=None, s3: S3Config | None = None, multiple: int = 1):
        self.manifest_uri, self.seed, self.s3, self.multiple = str(manifest), seed, s3, multiple
        self.manifest, self.tokenizer = open_training_manifest(self.manifest_uri, tokenizer, s3, chat=True, task="dpo")
        self.base = base_uri(self.manifest_uri)
        self.shards = sorted(self.manifest.shards, key=lambda s: s.index)
        self._starts = np.cumsum([0] + [s.rows for s in self.shards])
        self.total = int(self._starts[-1])
        if self.total == 0:
            raise DataError(f"{self.manifest_uri}: no preference pair in the training shards")
        self._cache = ShardCache(2)

    def _shard(self, k: int):
        return self._cache.get(k, self._load)

    def _load(self, k: int):
        s = self.shards[k]
        order = shard_order(self.seed, s.index, s.rows)
        return load_chat_shard(self.base, s.token_files, self.s3, order, f"{self.manifest_uri}: shards[{k}]")

    def docs(self, start: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The stored documents of global pairs [start, start + n) (mod total)."""
        out = []
        for g in (start + np.arange(n)) % self.total:
            k = int(np.searchsorted(self._starts, g, side="right") - 1)
            out.append(self._shard(k)[int(g) - int(self._starts[k])])
        return out

    def batch(self, start: int, n: int) -> PairBatch:
        return pair_batch(self.docs(start, n), self.tokenizer.eos_id, self.multiple)


def heldout_pairs(manifest: str, tokenizer=None, s3: S3Config | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every held-out pair document of a dpo manifest, in stored order (DataError when there is no held-out split)."""
    m, _ = open_training_manifest(str(manifest), tokenizer, s3, chat=True, task="dpo")
    if m.heldout is None or m.heldout.rows == 0:
        raise DataError(f"{manifest}: no held-out pairs (set sharding.heldout)")
    shard = load_chat_shard(base_uri(str(manifest)), m.heldout.token_files, s3, None, f"{manifest}: heldout")
    return [shard[j] for j in range(m.heldout.rows)]


def eval_pairs_file(path: str | Path, tokenizer_dir: str, chat) -> list[tuple[np.ndarray, np.ndarray]]:
    """A JSONL of preference pairs (validate.eval_data, `nightloom eval --data`) rendered as the shard stage does."""
    from nightloom.sharding.scan_chats import render_chat_file

    convs, _ = render_chat_file(Path(path), tokenizer_dir, chat)
    return [(np.asarray(c.ids), np.asarray(c.labels, dtype=np.uint8)) for c in convs]
