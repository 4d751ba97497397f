"""The scan's record path: one record at a time through sources.py's readers, which alone know line numbers, so
every problem is reported with file:line or counted (`on_error=skip`); good records reach the spill in batches.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import xxhash

from nightloom.sharding.errors import BadInputError, bad_record_error
from nightloom.sharding.hashing import DEDUP_SEED
from nightloom.sharding.job import ShardJob
from nightloom.sharding.manifest import BadRecord
from nightloom.sharding.scan_result import MAX_BAD_EXAMPLES, ScanResult
from nightloom.sharding.sources import SourceRef, read_records
from nightloom.sharding.spill import META_DTYPE, Spill, spill_tokenizer

SPILL_BATCH = 8192  # records per Arrow batch on the record path …
SPILL_BATCH_BYTES = 16 * 1024 * 1024  # … or this much text, whichever first (bounds memory for huge documents)


def key_bytes(key: object) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8")
    return orjson.dumps(key, option=orjson.OPT_SORT_KEYS)


def _strings(values: list[bytes]) -> pa.Array:
    """A string array straight from encoded bytes (no Python str round trip)."""
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:  # one spill batch holds at most SPILL_BATCH_BYTES + one document
        raise BadInputError(f"a document of {int(lengths.max()):,} bytes: documents over 2 GiB are not supported")
    return pa.StringArray.from_buffers(
        len(values), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(values))
    )


class RecordBuffer:
    """Good records of the record path, batched across the files of a unit before they reach the spill (one
    small file per batch would make the writers walk thousands of tiny batches)."""

    def __init__(self, job: ShardJob, spill: Spill):
        self.spill = spill
        self.separate_key = job.sharding.key_field is not None and job.sharding.key_field != job.dataset.text_field
        self.kept: list[list[str | None]] = [[] for _ in job.extra_columns]
        self.texts: list[bytes] = []
        self.keys: list[bytes] = []
        self.meta: list[tuple[int, int, int, int, int]] = []  # pos is set by the spill
        self.pending = 0
        self.count = 0  # documents added so far (spilled or buffered)
        self.tok = spill_tokenizer(job)  # None for bytes (tokens = UTF-8 bytes, already in meta)
        self.ids: list[list[int]] = []  # chats (scan_chats.py): ids and labels rendered already, not tokenized here
        self.labels: list[list[int]] = []

    def add(
        self,
        tb: bytes,
        kb: bytes,
        meta: tuple[int, int, int, int, int],
        extras,
        ids: list[int] | None = None,
        labels: list[int] | None = None,
    ) -> None:
        """One good record; a chat comes with its ids and labels (meta's tokens = their length)."""
        if ids is not None:
            self.ids.append(ids)
            self.labels.append(labels)
        self.texts.append(tb)
        if self.separate_key:
            self.keys.append(kb)
        self.meta.append(meta)
        self.pending += meta[3]
        for values, v in zip(self.kept, extras):
            values.append(v)
            self.pending += len(v) if v is not None else 0  # bounds memory only; never counted in meta
        self.count += 1
        if len(self.texts) >= SPILL_BATCH or self.pending >= SPILL_BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.texts:
            return
        cols = [_strings(self.texts)] + ([_strings(self.keys)] if self.separate_key else [])
        cols += [pa.array(values, type=pa.string()) for values in self.kept]
        meta = np.array(self.meta, dtype=META_DTYPE)
        ids = labels = None
        if self.ids:
            ids = np.fromiter(itertools.chain.from_iterable(self.ids), dtype=np.int64, count=int(meta["tokens"].sum()))
            labels = np.fromiter(itertools.chain.from_iterable(self.labels), dtype=np.uint8, count=len(ids))
        elif self.tok is not None:
            meta["tokens"], ids = self.tok.encode_ids([t.decode("utf-8") for t in self.texts])
        self.spill.add(cols, meta, ids, labels)
        self.texts.clear(), self.keys.clear(), self.meta.clear(), self.ids.clear(), self.labels.clear()
        for values in self.kept:
            values.clear()
        self.pending = 0


def count_bad(res: ScanResult, src: SourceRef, where: int, err: str, fail: bool) -> None:
    """One bad record at `where` (a line, or a row of a columnar file): BadInputError naming file:line under
    `on_error=fail`, else counted, the first MAX_BAD_EXAMPLES kept for the report."""
    if fail:
        raise bad_record_error(src.uri, where, err)
    res.bad += 1
    if len(res.bad_examples) < MAX_BAD_EXAMPLES:
        res.bad_examples.append(BadRecord(file=src.rel, line=where, reason=err))


def scan_records(
    local: Path, src: SourceRef, job: ShardJob, buf: RecordBuffer, res: ScanResult, span: tuple[int, int] | None
) -> None:
    """Record path: exact file:line for every problem; honours on_error."""
    text_field, key_field = job.dataset.text_field, job.sharding.key_field
    salt = job.sharding.salt.encode("utf-8")
    fail = job.sharding.on_error == "fail"
    xx64, xx3 = xxhash.xxh64_intdigest, xxhash.xxh3_64_intdigest
    items = read_records(local, src.format, text_field, key_field, job.extra_columns, span=span)
    for where, text, key, err, extras in items:
        res.records += 1
        if err is not None:
            count_bad(res, src, where, err, fail)
            continue
        if not text or text.isspace():
            res.empty += 1
            continue
        tb = text.encode("utf-8")
        kb = tb if key is None else key_bytes(key)
        nb = len(tb)  # tokenizer "bytes": one token per UTF-8 byte
        nb_all = nb + len(kb) if buf.separate_key else nb
        buf.add(tb, kb, (xx64(kb + salt), xx3(kb, seed=DEDUP_SEED), nb, nb_all, 0), extras)
