"""Packed token batches read through the shard manifest, deterministic per step and layout-independent.

The dataset is one virtual stream of fixed windows of `seq_len + 1` tokens: shards in manifest order, each
shard's documents as the run's tokenizer ids with its EOS after every document (tokenizer `bytes`: UTF-8 bytes
and a separator token 0, the original stream), cut into whole windows
(the tail of a shard that does not fill a window is dropped). Window counts come from the manifest
(`tokens + rows` stream tokens per shard), so a rank can locate any window without reading other shards.

A shard's stream is its token file (`.bin`, Megatron's indexed dataset, written by the shard stage: exactly
that stream), memory-mapped, so training tokenizes nothing and touches only the windows it reads. Shards of a
manifest written before token files existed (schema < 3) are read from their Parquet text and tokenized at
load time, as before; both give the same windows.

With a seed, each shard's windows are permuted (numpy PCG64 seeded by (seed, shard index)): a shard spans the
whole corpus, so neighbouring windows no longer come from neighbouring documents (runs of hard batches from one
module looked like loss spikes), while a rank still reads only the shards its slice touches.

train.task sft reads conversations instead (`ConversationRows`): one conversation per sequence (a shard's
documents, its .idx gives their lengths), padded to seq_len + 1 ids, with the shard's label file (1 = an
assistant token) turned into targets: the next id where it is a label, IGNORE_INDEX elsewhere. StepLoader cuts
each micro-batch to its longest row (train/sft_batch.py; with train.group_by_length rows of similar length share
one). No row holds two
conversations, so no attention crosses one; rows are permuted per shard with the same seeded scheme as windows.
With train.pack a row holds several whole conversations (nightloom/train/packing.py: first-fit in that seeded
order, planned per shard from its .idx lengths at start) and per-id document ids the model masks attention by.

The global batch of step k is windows (or rows) [k*G, (k+1)*G) (mod their number: epochs wrap), and DP rank r
gets the contiguous slice [r*G/dp, (r+1)*G/dp) of it. Hence step k sees the same set of sequences for every
layout (parity and re-layout resume), every rank does the same number of micro-batches, and each DP rank
reads only the one or two shards its slice touches.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nightloom.sharding.manifest import MANIFEST_NAME, ShardManifest, load_manifest
from nightloom.spec import TokenizerSpec
from nightloom.storage import S3Config, read_bytes
from nightloom.tokenizer import Tokenizer, load_tokenizer

SEPARATOR = 0
IGNORE_INDEX = -100  # a target that is not a label (F.cross_entropy's default ignore_index)


class DataError(ValueError):
    """A manifest or shard the trainer cannot read; the message names the file and field."""


@dataclass(frozen=True)
class ShardWindows:
    """Where one shard's windows sit in the global window stream."""

    index: int
    uri: str
    first: int  # global index of this shard's first window
    count: int
    stream_tokens: int  # tokens + rows (one separator per document), from the manifest
    bin_uri: str | None = None  # the shard's token file (None: an older manifest; read the text)
    bin_dtype: str = "uint16"
    bin_tokens: int = 0  # ids in the token file, per the manifest


def base_uri(manifest: str) -> str:
    """The folder (or S3 prefix) a manifest's relative file names resolve against."""
    s = str(manifest)
    if s.startswith("s3://"):
        return s.rsplit("/", 1)[0] if s.endswith(".json") else s.rstrip("/")
    p = Path(s)
    return str(p.parent if p.is_file() or p.name == MANIFEST_NAME else p)


def _read_bytes(uri: str, s3: S3Config | None = None) -> bytes:
    if uri.startswith("s3://"):
        return read_bytes(uri, s3)
    p = Path(uri)
    if not p.is_file():
        raise DataError(f"{p}: shard listed in the manifest does not exist")
    return p.read_bytes()


def shard_uri(base: str, rel: str) -> str:
    """A shard file's URI: `rel` (as the manifest names it) under the manifest's folder or S3 prefix `base`."""
    return f"{base}/{rel}" if base.startswith("s3://") else str(Path(base) / rel)


def shard_order(seed: int | None, index: int, count: int) -> np.ndarray | None:
    """A shard's seeded order of its windows or rows (numpy PCG64 seeded by (seed, shard index)), None unseeded."""
    return None if seed is None else np.random.default_rng([seed, index]).permutation(count)


class ShardCache:
    """The last `size` shards loaded (least recently used goes first): each rank reads one or two at a time."""

    def __init__(self, size: int):
        self.size, self.shards = size, OrderedDict()

    def __iter__(self):
        """The cached shards' indices, least recently used first."""
        return iter(self.shards)

    def get(self, k: int, load):
        """Shard `k`, loaded by `load(k)` unless it is cached."""
        if k in self.shards:
            self.shards.move_to_end(k)
            return self.shards[k]
        shard = self.shards[k] = load(k)
        if len(self.shards) > self.size:
            self.shards.popitem(last=False)
        return shard


def pack_documents(texts: list[str]) -> np.ndarray:
    """UTF-8 bytes of each document followed by the separator token, as one uint8 stream."""
    sep = bytes([SEPARATOR])
    return np.frombuffer(b"".join(t.encode("utf-8") + sep for t in texts), dtype=np.uint8)


class _TokenShard:
    """One shard's windows straight from its token ids (a memory map locally): window j is ids[w·o : w·o + w]
    with o = order[j] (the seeded permutation) or j."""

    def __init__(self, ids: np.ndarray, window: int, order: np.ndarray | None):
        self.ids, self.window, self.order = ids, window, order

    def __getitem__(self, j: int) -> np.ndarray:
        o = int(self.order[j]) if self.order is not None else j
        return self.ids[o * self.window : (o + 1) * self.window]


def open_training_manifest(
    manifest: str, tokenizer: TokenizerSpec | str | None, s3: S3Config | None, *, chat: bool, task: str = "sft"
) -> tuple[ShardManifest, Tokenizer]:
    """The manifest and the run's tokenizer, checked against each other and against the task: a pretraining stream
    (`chat=False`) or conversations with labels (`chat=True`, train.task sft). DataError naming the manifest."""
    m, tok = load_manifest(manifest, s3), load_tokenizer(tokenizer)
    if m.tokenizer != tok.fingerprint():
        raise DataError(
            f"{manifest}: tokenizer: the shards were counted with {m.tokenizer!r}, the run uses "
            f"{tok.fingerprint()!r} (re-shard with the run's model.tokenizer)"
        )
    if chat and m.chat is None:
        raise DataError(
            f"{manifest}: not a chat dataset (no `chat` in the manifest): train.task sft needs shards made with "
            "train.task: sft"
        )
    if chat and m.chat.task != task:
        raise DataError(
            f"{manifest}: sharded for train.task {m.chat.task} (dpo: preference pairs; sft: conversations), not "
            f"{task}: set train.task: {m.chat.task}, or re-shard with train.task: {task}"
        )
    if not chat and m.chat is not None:
        raise DataError(
            f"{manifest}: a chat dataset (sharded for train.task sft: conversations and their labels), not a "
            "pretraining stream: set train.task: sft, or re-shard with train.task: pretrain"
        )
    return m, tok


class ShardStream:
    """What the training streams share: the manifest, opened and checked against the run's tokenizer (`chat`: a
    chat manifest), windows of seq_len + 1 ids, the seed of each shard's order, where s3:// shards live (the
    job's storage config), and the last `cache_shards` shards loaded by the stream's `_load`."""

    chat = False

    def __init__(
        self,
        manifest: str,
        seq_len: int,
        cache_shards: int = 2,
        seed: int | None = None,
        tokenizer: TokenizerSpec | str | None = None,
        s3: S3Config | None = None,
    ):
        self.manifest_uri, self.seed, self.s3 = str(manifest), seed, s3
        self.manifest, self.tokenizer = open_training_manifest(self.manifest_uri, tokenizer, s3, chat=self.chat)
        self.window, self.base = seq_len + 1, base_uri(manifest)
        self._cache = ShardCache(cache_shards)

    def _shard(self, k: int):
        return self._cache.get(k, self._load)


class PackedWindows(ShardStream):
    """Random access to the global window stream; shards are loaded lazily and a few are cached (arguments:
    ShardStream's)."""

    def __init__(self, manifest: str, seq_len: int, **options: Any):
        super().__init__(manifest, seq_len, **options)
        spans, first = [], 0

        def at(rel: str) -> str:
            return shard_uri(self.base, rel)

        for i, s in enumerate(sorted(self.manifest.shards, key=lambda s: s.index)):
            stream = s.tokens + s.rows
            n = stream // self.window
            tf = s.token_files
            if tf is None:
                spans.append(ShardWindows(s.index, at(s.path), first, n, stream))
            else:
                if tf.eos_id != self.tokenizer.eos_id:
                    raise DataError(
                        f"{self.manifest_uri}: shards[{i}].token_files.eos_id = {tf.eos_id}, the run's tokenizer "
                        f"ends documents with {self.tokenizer.eos_id}"
                    )
                spans.append(ShardWindows(s.index, at(s.path), first, n, stream, at(tf.bin), tf.dtype, tf.tokens))
            first += n
        self.spans = spans
        self.total = first
        if self.total == 0:
            raise DataError(
                f"{self.manifest_uri}: {self.manifest.tokens} tokens in {len(spans)} shards do not "
                f"fill one window of seq_len+1 = {self.window} tokens"
            )
        self._starts = np.array([s.first for s in spans])

    def _load(self, k: int) -> np.ndarray | _TokenShard:
        return self._load_text(k) if self.spans[k].bin_uri is None else self._load_tokens(k)

    def _order(self, span: ShardWindows) -> np.ndarray | None:
        """The shard's window order: `shard_order`."""
        return shard_order(self.seed, span.index, span.count)

    def _load_tokens(self, k: int) -> _TokenShard:
        from nightloom.sharding.tokens import np_dtype

        span = self.spans[k]
        ids = _array(span.bin_uri, np_dtype(span.bin_dtype), self.s3, "token file")
        if len(ids) != span.bin_tokens or len(ids) < span.count * self.window:
            raise DataError(
                f"{span.bin_uri}: manifest field shards[{k}] says tokens+rows = {span.stream_tokens} "
                f"(token_files.tokens = {span.bin_tokens}) but the token file holds {len(ids)} {span.bin_dtype} ids"
            )
        return _TokenShard(ids, self.window, self._order(span))

    def _load_text(self, k: int) -> np.ndarray:
        import pyarrow.parquet as pq

        span = self.spans[k]
        table = pq.read_table(io.BytesIO(_read_bytes(span.uri, self.s3)), columns=[self.manifest.text_field])
        texts = table.column(self.manifest.text_field).to_pylist()
        stream = pack_documents(texts) if self.tokenizer.kind == "bytes" else self.tokenizer.stream(texts)
        if len(stream) < span.count * self.window:
            raise DataError(
                f"{span.uri}: manifest field shards[{k}] says tokens+rows = {span.stream_tokens} but the shard "
                f"packs to {len(stream)} {self.tokenizer.kind} tokens (text field {self.manifest.text_field!r})"
            )
        arr = stream[: span.count * self.window].reshape(span.count, self.window)
        order = self._order(span)
        return arr if order is None else arr[order]

    def windows(self, start: int, n: int) -> torch.Tensor:
        """Global windows [start, start+n) (mod total), as int64 (n, seq_len+1)."""
        out = np.empty((n, self.window), dtype=np.int64)
        for j in range(n):
            g = (start + j) % self.total
            k = int(np.searchsorted(self._starts, g, side="right") - 1)
            out[j] = self._shard(k)[g - self.spans[k].first]
        return torch.from_numpy(out)

    def sequences(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of windows [start, start+n): every next id is a target."""
        seqs = self.windows(start, n)
        return seqs[:, :-1], seqs[:, 1:]


def read_eval_texts(
    manifest: str, eval_data: str | None, text_field: str | None = None, s3: S3Config | None = None
) -> tuple[str, list[str]]:
    """(where, documents) of the eval set: `eval_data` (a JSONL file) if given, else the manifest's held-out split."""
    if eval_data:
        from nightloom.sharding.sources import read_records

        p = Path(eval_data)
        if not p.is_file():
            raise DataError(f"{p}: validate.eval_data: file not found")
        field = text_field or load_manifest(manifest, s3).text_field
        texts = []
        for where, text, _, err, _ in read_records(p, "jsonl", field, None):
            if err is not None:
                raise DataError(f"{p}:{where}: {err}")
            if text:
                texts.append(text)
        return str(p), texts
    m = load_manifest(manifest, s3)
    if m.heldout is None:
        raise DataError(
            f"{manifest}: validate.eval_every needs a held-out split (sharding.heldout) or validate.eval_data"
        )
    import pyarrow.parquet as pq

    uri = f"{base_uri(manifest)}/{m.heldout.path}"
    table = pq.read_table(io.BytesIO(_read_bytes(uri, s3)), columns=[m.text_field])
    return uri, table.column(m.text_field).to_pylist()


def eval_windows(texts: list[str], tokenizer: Tokenizer, seq_len: int, n: int, where: str) -> torch.Tensor:
    """The first `n` windows of seq_len+1 tokens of the eval documents' stream (ids + EOS each): fixed for the
    whole run, so every evaluation scores the same tokens. Fewer if the documents do not fill `n`."""
    return _first_windows(tokenizer.stream(texts), seq_len, n, where)


def _first_windows(stream: np.ndarray, seq_len: int, n: int, where: str) -> torch.Tensor:
    k = min(n, len(stream) // (seq_len + 1))
    if k == 0:
        raise DataError(f"{where}: {len(stream)} eval tokens do not fill one window of seq_len+1 = {seq_len + 1}")
    return torch.from_numpy(np.asarray(stream[: k * (seq_len + 1)], dtype=np.int64).reshape(k, seq_len + 1))


def _heldout_ids(manifest: str, m: ShardManifest, tokenizer: Tokenizer, need: int, s3: S3Config | None):
    """(where, the first `need` ids of the held-out token file) or None when the manifest lists no token file for
    it (written before schema 3) or they were made by another tokenizer: then the text is tokenized instead."""
    from nightloom.sharding.tokens import np_dtype

    tf = m.heldout.token_files if m.heldout is not None else None
    if tf is None or m.tokenizer != tokenizer.fingerprint() or tf.eos_id != tokenizer.eos_id:
        return None
    uri = f"{base_uri(manifest)}/{tf.bin}"
    dtype = np_dtype(tf.dtype)
    if uri.startswith("s3://"):
        ids = np.frombuffer(_read_bytes(uri, s3), dtype=dtype)
    else:
        p = Path(uri)
        if not p.is_file():
            raise DataError(f"{p}: held-out token file listed in the manifest does not exist")
        ids = np.fromfile(p, dtype=dtype, count=min(need, p.stat().st_size // dtype.itemsize))
    if len(ids) < min(need, tf.tokens):
        raise DataError(f"{uri}: manifest field heldout.token_files.tokens = {tf.tokens}, the file holds {len(ids)}")
    return uri, ids[:need]


def read_eval_windows(
    manifest: str, eval_data: str | None, tokenizer: Tokenizer, seq_len: int, n: int, s3: S3Config | None = None
) -> tuple[str, torch.Tensor]:
    """(where, the first `n` eval windows): from the held-out split's token file (.bin, written by the shard stage:
    nothing is tokenized), else (`eval_data`, or a manifest without held-out token files) from the text."""
    if not eval_data:
        m = load_manifest(manifest, s3)
        got = _heldout_ids(manifest, m, tokenizer, n * (seq_len + 1), s3)
        if got is not None:
            return got[0], _first_windows(got[1], seq_len, n, got[0])
    where, texts = read_eval_texts(manifest, eval_data, s3=s3)
    return where, eval_windows(texts, tokenizer, seq_len, n, where)


@dataclass(frozen=True)
class StepBatch:
    """One DP rank's share of one optimizer step: `micro` lists (inputs, targets) of (micro_batch, seq_len);
    `docs` (train.pack) each micro-batch's document ids of the inputs (the model's block-causal mask), else None."""

    step: int
    micro: list[tuple[torch.Tensor, torch.Tensor]]
    docs: list[torch.Tensor] | None = None

    @property
    def inputs(self) -> torch.Tensor:
        return torch.cat([x for x, _ in self.micro])

    @property
    def targets(self) -> torch.Tensor:
        return torch.cat([y for _, y in self.micro])


class StepLoader:
    """Batches by step number: resuming at step k needs no state other than k."""

    def __init__(
        self,
        windows,
        micro_batch: int,
        grad_accum: int,
        dp: int,
        dp_rank: int,
        width_multiple: int | None = 1,
        group_by_length: bool = False,
    ):
        """`windows`: PackedWindows (pretraining) or ConversationRows (sft). Unpacked sft micro-batches are cut to
        their longest row, rounded up to `width_multiple` (None: seq_len), and with `group_by_length` each global
        batch is grouped by length (train/sft_batch.py)."""
        self.w, self.mb, self.ga, self.dp, self.dp_rank = windows, micro_batch, grad_accum, dp, dp_rank
        self.global_batch = micro_batch * grad_accum * dp
        self.width_multiple, self.group_by_length = width_multiple, group_by_length

    def batch(self, step: int) -> StepBatch:
        local = self.mb * self.ga
        start = step * self.global_batch + self.dp_rank * local
        if getattr(self.w, "pack", False):
            x, y, d = self.w.packed_sequences(start, local)
            micro = [(x[i : i + self.mb], y[i : i + self.mb]) for i in range(0, local, self.mb)]
            return StepBatch(step, micro, [d[i : i + self.mb] for i in range(0, local, self.mb)])
        if isinstance(self.w, ConversationRows):
            return StepBatch(step, self._conversations(step))
        x, y = self.w.sequences(start, local)
        micro = [(x[i : i + self.mb], y[i : i + self.mb]) for i in range(0, local, self.mb)]
        return StepBatch(step, micro)

    def _conversations(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Unpacked sft: this rank's micro-batches of step `step`, each as wide as its longest row needs; with
        group_by_length the global batch's rows are grouped first (sft_batch.length_order)."""
        from nightloom.train.sft_batch import length_order, micro_batches

        local, first = self.mb * self.ga, step * self.global_batch
        if self.group_by_length:
            order = length_order(self.w.lengths(first, self.global_batch), self.mb, self.dp)
            rows = first + order[self.dp_rank * local : (self.dp_rank + 1) * local]
        else:
            rows = first + self.dp_rank * local + np.arange(local)
        ids, labels, lengths = self.w.rows_at(rows)
        return micro_batches(*chat_targets(ids, labels), lengths, self.mb, self.width_multiple)


def chat_targets(ids: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of padded conversation rows (n, seq_len+1): the next id where it is a label, else
    IGNORE_INDEX."""
    ids_t, labels_t = torch.from_numpy(ids), torch.from_numpy(labels.astype(bool))
    return ids_t[:, :-1], torch.where(labels_t[:, 1:], ids_t[:, 1:], IGNORE_INDEX)


class _ChatShard:
    """One shard's conversations: ids and labels (memory maps locally) and each one's offset and length."""

    def __init__(self, ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, order: np.ndarray | None):
        self.ids, self.labels, self.lengths, self.order = ids, labels, lengths, order
        self.starts = np.cumsum(lengths) - lengths

    def __getitem__(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        o = int(self.order[j]) if self.order is not None else j
        a, n = int(self.starts[o]), int(self.lengths[o])
        return self.ids[a : a + n], self.labels[a : a + n]


def _array(uri: str, dtype: np.dtype, s3: S3Config | None, what: str) -> np.ndarray:
    if uri.startswith("s3://"):
        return np.frombuffer(_read_bytes(uri, s3), dtype=dtype)
    p = Path(uri)
    if not p.is_file():
        raise DataError(f"{p}: {what} listed in the manifest does not exist")
    return np.memmap(p, dtype=dtype, mode="r") if p.stat().st_size else np.zeros(0, dtype=dtype)


def load_chat_shard(base: str, tf, s3: S3Config | None, order: np.ndarray | None, where: str) -> _ChatShard:
    """A shard's (or the held-out split's) conversations from its token files and label file."""
    from nightloom.sharding.tokens import LABEL_DTYPE, np_dtype, read_lengths

    def at(rel: str) -> str:
        return shard_uri(base, rel)

    if tf is None or tf.labels is None:
        raise DataError(
            f"{where}: no label file: train.task sft needs shards made for it (re-shard with train.task: sft)"
        )
    ids = _array(at(tf.bin), np_dtype(tf.dtype), s3, "token file")
    labels = _array(at(tf.labels), LABEL_DTYPE, s3, "label file")
    lengths = read_lengths(_read_bytes(at(tf.idx), s3))
    if len(ids) != tf.tokens or len(labels) != len(ids) or int(lengths.sum()) != len(ids):
        raise DataError(
            f"{at(tf.bin)}: token_files.tokens = {tf.tokens}, but the token file holds {len(ids)} ids, the label "
            f"file {len(labels)} and the index {int(lengths.sum())}"
        )
    return _ChatShard(ids, labels, lengths, order)


class ConversationRows(ShardStream):
    """train.task sft: random access to the global row stream, one conversation per row, or with `pack` several
    (see the module docstring); shards are loaded lazily and a few are cached (other arguments: ShardStream's)."""

    chat = True

    def __init__(self, manifest: str, seq_len: int, *, pack: bool = False, **options: Any):
        super().__init__(manifest, seq_len, **options)
        self.pack = pack
        self.shards = sorted(self.manifest.shards, key=lambda s: s.index)
        self.plans = [self._plan(k) for k in range(len(self.shards))] if pack else None
        counts = [p.rows for p in self.plans] if pack else [s.rows for s in self.shards]
        self._starts = np.cumsum([0] + counts)
        self.total = int(self._starts[-1])
        if self.total == 0:
            raise DataError(f"{self.manifest_uri}: no conversation in the training shards")
        self._lengths: np.ndarray | None = None  # every row's length, once `lengths` is asked

    def _order(self, k: int) -> np.ndarray | None:
        return shard_order(self.seed, self.shards[k].index, self.shards[k].rows)

    def _idx_lengths(self, k: int) -> np.ndarray:
        """Shard k's conversation lengths in stored order, from its .idx file alone."""
        from nightloom.sharding.tokens import read_lengths

        tf = self.shards[k].token_files
        if tf is None or tf.labels is None:
            raise DataError(f"{self.manifest_uri}: shards[{k}]: no label file: train.task sft needs shards made for it")
        return read_lengths(_read_bytes(shard_uri(self.base, tf.idx), self.s3))

    def lengths(self, start: int, n: int) -> np.ndarray:
        """Unpacked: the conversation lengths (ids) of global rows [start, start+n) (mod total); every shard's
        .idx is read once, on the first call (train.group_by_length sorts a whole global batch by them)."""
        if self._lengths is None:
            parts = [self._idx_lengths(k) for k in range(len(self.shards))]
            orders = [self._order(k) for k in range(len(self.shards))]
            self._lengths = np.concatenate([p if o is None else p[o] for p, o in zip(parts, orders)])
        return self._lengths[(start + np.arange(n)) % self.total]

    def _plan(self, k: int):
        """Shard k's packed rows, from its .idx lengths alone (first-fit in its seeded order)."""
        from nightloom.train.packing import first_fit

        lengths = self._idx_lengths(k)
        try:
            return first_fit(lengths, self._order(k), self.window)
        except ValueError as e:
            raise DataError(
                f"{self.manifest_uri}: shards[{k}]: {e} (sharded with seq_len {self.manifest.chat.seq_len}; "
                "re-shard with this one)"
            ) from None

    def stats(self):
        """train.pack: PackStats (conversations per row, the share of ids that are tokens) over all shards."""
        from nightloom.train.packing import PackStats

        plans = self.plans or []
        return PackStats(sum(len(p.members) for p in plans), self.total, sum(p.ids for p in plans), self.window)

    def _load(self, k: int) -> _ChatShard:
        # packed: the plan holds the seeded order, so the shard is read in stored order
        order = None if self.pack else self._order(k)
        return load_chat_shard(
            self.base, self.shards[k].token_files, self.s3, order, f"{self.manifest_uri}: shards[{k}]"
        )

    def rows(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels) of global rows [start, start+n) (mod total), each (n, seq_len+1), padded with EOS ids
        whose labels are 0 (train.pack: packed rows)."""
        if self.pack:
            return self.packed_rows(start, n)[:2]
        return self.rows_at(start + np.arange(n))[:2]

    def rows_at(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unpacked: (ids, labels, lengths) of global rows `rows` (mod total), ids and labels (n, seq_len+1) padded
        with EOS ids whose labels are 0, lengths the conversations' ids."""
        n = len(rows)
        ids = np.full((n, self.window), self.tokenizer.eos_id, dtype=np.int64)
        labels = np.zeros((n, self.window), dtype=np.uint8)
        lengths = np.zeros(n, dtype=np.int64)
        for j in range(n):
            g = int(rows[j]) % self.total
            k = int(np.searchsorted(self._starts, g, side="right") - 1)
            a, b = self._shard(k)[g - int(self._starts[k])]
            if len(a) > self.window:
                raise DataError(
                    f"{self.manifest_uri}: a conversation of {len(a)} ids in shards[{k}] is longer than seq_len+1 = "
                    f"{self.window} (sharded with seq_len {self.manifest.chat.seq_len}; re-shard with this one)"
                )
            ids[j, : len(a)], labels[j, : len(a)], lengths[j] = a, b, len(a)
        return ids, labels, lengths

    def sequences(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of rows [start, start+n): targets are IGNORE_INDEX where the next id is no label."""
        if self.pack:
            return self.packed_sequences(start, n)[:2]
        return chat_targets(*self.rows(start, n))

    def packed_rows(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """train.pack: (ids, labels, docs) of packed global rows [start, start+n) (mod total), each (n,
        seq_len+1): whole conversations back to back, then EOS padding (packing.fill_row)."""
        from nightloom.train.packing import fill_row

        out = [np.empty((n, self.window), dtype=t) for t in (np.int64, np.uint8, np.int64)]
        for j in range(n):
            g = (start + j) % self.total
            k = int(np.searchsorted(self._starts, g, side="right") - 1)
            shard = self._shard(k)
            convs = [shard[int(c)] for c in self.plans[k].row(g - int(self._starts[k]))]
            for arr, row in zip(out, fill_row(convs, self.window, self.tokenizer.eos_id)):
                arr[j] = row
        return out[0], out[1], out[2]

    def packed_sequences(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """train.pack: (inputs, targets, document ids of the inputs) of packed rows [start, start+n)."""
        ids, labels, docs = self.packed_rows(start, n)
        x, y = chat_targets(ids, labels)
        return x, y, torch.from_numpy(docs[:, :-1])


def pad_rows(conversations: list[tuple[list[int], list[int]]], window: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, labels) rows of `window` ids from conversations of at most that many, padded with `pad` (label 0)."""
    ids = np.full((len(conversations), window), pad, dtype=np.int64)
    labels = np.zeros((len(conversations), window), dtype=np.uint8)
    for j, (a, b) in enumerate(conversations):
        ids[j, : len(a)], labels[j, : len(a)] = a, b
    return ids, labels


def read_eval_rows(
    manifest: str,
    eval_data: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    n: int,
    chat=None,
    s3: S3Config | None = None,
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """train.task sft: (where, inputs, targets) of the first `n` eval conversations, from the held-out split's
    token and label files, or `eval_data` (a JSONL of chat records, rendered with `chat`, nightloom.chat's
    ChatSettings, as the shard stage does)."""
    window = seq_len + 1
    if eval_data:
        from nightloom.chat import ChatError
        from nightloom.sharding.scan_chats import render_chat_file

        try:
            convs, _ = render_chat_file(Path(eval_data), getattr(tokenizer, "folder", ""), chat)
        except ChatError as e:
            raise DataError(f"validate.eval_data: {e}") from None
        if not convs:
            raise DataError(f"{eval_data}: validate.eval_data: no conversation fits seq_len+1 = {window} ids")
        ids, labels = pad_rows([(c.ids, c.labels) for c in convs[:n]], window, tokenizer.eos_id)
        return eval_data, *chat_targets(ids, labels)
    m = load_manifest(manifest, s3)
    if m.heldout is None:
        raise DataError(
            f"{manifest}: validate.eval_every needs a held-out split (sharding.heldout) or validate.eval_data"
        )
    shard = load_chat_shard(base_uri(manifest), m.heldout.token_files, s3, None, f"{manifest}: heldout")
    k = min(n, len(shard.lengths))
    if k == 0:
        raise DataError(f"{manifest}: the held-out split holds no conversation")
    rows = [tuple(np.asarray(v) for v in shard[j]) for j in range(k)]
    if max(len(a) for a, _ in rows) > window:
        raise DataError(f"{manifest}: a held-out conversation is longer than seq_len+1 = {window} ids (re-shard)")
    ids, labels = pad_rows(rows, window, tokenizer.eos_id)
    return f"{base_uri(manifest)}/{m.heldout.token_files.bin}", *chat_targets(ids, labels)
