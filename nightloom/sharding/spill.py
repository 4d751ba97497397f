"""The scan's spill: kept records as Arrow IPC parts, with their meta, token ids and batch index as array files.

Spill parts hold the text (and key); a META_DTYPE array file holds both hashes, tokens, bytes and input position per
record; with a tokenizer other than `bytes` an ids file holds every record's token ids (tokenized once, in the
scan: they give the counts the balancer uses and the shard's .bin token file).

Each batch that reaches the spill is split by plain shard (H mod N, the shard of every bucket the balancer does
not move) into one Arrow record batch per shard, listed in a BATCH_DTYPE index: a shard writer then reads its own
partition of every spill, not the whole spill once per shard (which made writing grow as shards × corpus). A
spill part (SPILL_PART_BYTES of text, held until then) is written partition-major: a plain shard's batches of the
whole part are adjacent, so a writer reads them with one read, on S3 one ranged GET, not one per batch.
Meta, ids and the placement's dest file follow the spill's row order; META_DTYPE's `pos` gives each record's
place in input order within the unit, so a writer can restore input order where partitions meet.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from nightloom.sharding.arrays import ArrayWriter
from nightloom.sharding.job import ShardJob
from nightloom.sharding.tokens import np_dtype

SPILL_PART_BYTES = 32 * 1024 * 1024  # text per spill part: what a scan holds before writing it, shard by shard
META_DTYPE = np.dtype([("h1", "<u8"), ("h2", "<u8"), ("tokens", "<i8"), ("nbytes", "<i8"), ("pos", "<i8")])
# one entry per spilled record batch, in spill order: its spill part (file) and the bytes it takes there (offset,
# length: a writer reads just those, with no IPC footer to open; the first batch of a part also holds the file's
# magic and schema message), its segment (the batches of one segment cover one run of input positions: a part),
# its plain shard (part), its rows, and where they start in the meta/dest files (row) and in the ids file (tok).
# Entries adjacent in the spill are adjacent in meta, dest and ids too: a writer reads a run of them at once.
BATCH_DTYPE = np.dtype(
    [
        ("file", "<i4"),
        ("part", "<i4"),
        ("offset", "<i8"),
        ("length", "<i8"),
        ("segment", "<i8"),
        ("rows", "<i8"),
        ("row", "<i8"),
        ("tok", "<i8"),
    ]
)


def spill_schema(job: ShardJob) -> pa.Schema:
    """The shard's own column types (pa.string: batches are bounded far below 2 GiB), so the writer casts nothing."""
    fields = [pa.field(job.dataset.text_field, pa.string())]
    if job.sharding.key_field and job.sharding.key_field != job.dataset.text_field:
        fields.append(pa.field(job.sharding.key_field, pa.string()))
    fields += [pa.field(c, pa.string()) for c in job.extra_columns]  # kept verbatim; never hashed
    return pa.schema(fields)


def row_indices(rows: np.ndarray) -> pa.Array:
    """Row numbers as the int64 Arrow array `take` wants, without a copy. (pa.array on a numpy array first
    imports pandas to ask whether it is a Series: 0.2-0.6 s of a core, GIL held, in every process that shards.)"""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])


def partition_order(h1: np.ndarray, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(stable order that groups rows by plain shard h1 mod N, each shard's [start, stop) in that order)."""
    part = (h1 % np.uint64(num_shards)).astype(np.int64)
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(num_shards + 1))
    return order, bounds


def gather_ids(ids: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Documents' ids (back to back, `lengths` each) rearranged into document order `order`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    sel = lengths[order]
    if not len(sel) or not int(sel.sum()):
        return ids[:0]
    shift = np.repeat(starts[order] - (np.cumsum(sel) - sel), sel)
    return ids[np.arange(int(sel.sum()), dtype=np.int64) + shift]


class Spill:
    """Collects (columns, meta[, token ids]) batches, each put in plain-shard order as it comes, and writes them a
    spill part at a time (each published with a rename; a part is SPILL_PART_BYTES of text, the bytes held here
    before it is written): partition-major, so a plain shard's rows of a whole part lie together in the part, the
    meta file and the ids file, and a writer reads them with one read (a ranged GET on S3) of each, not one per
    batch. The meta records, the token ids and the batch index go to array files as the parts are written."""

    def __init__(self, work: Path, index: int, schema: pa.Schema, id_dtype: str = "int32", num_shards: int = 1):
        self.work, self.index, self.schema, self.id_dtype = work, index, schema, id_dtype
        self.num_shards = num_shards
        self.parts: list[str] = []
        self.meta_name = f"meta-{index:05d}.bin"
        self.ids_name = f"ids-{index:05d}.bin"
        self.labels_name = f"labels-{index:05d}.bin"  # chats: a uint8 0/1 per id, aligned with the ids file
        self.batches_name = f"batches-{index:05d}.bin"
        self.meta: ArrayWriter | None = None
        self.ids: ArrayWriter | None = None
        self.labels: ArrayWriter | None = None
        self.batches: ArrayWriter | None = None
        # batches not written yet: (record batch, its meta, its ids or None, each plain shard's [start, stop), its
        # labels or None)
        self.pending: list[tuple[pa.RecordBatch, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]] = []
        self.pending_bytes = 0
        self.rows = self.written = self.tokens = 0  # rows added (input positions), rows and ids written

    def add(
        self, columns: list[pa.Array], meta: np.ndarray, ids: np.ndarray | None = None, labels: np.ndarray | None = None
    ) -> None:
        """`ids`: the records' token ids back to back (meta["tokens"] of them per record), or None for bytes;
        `labels`: chats' 0/1 label per id (uint8, aligned with `ids`), else None."""
        if not len(meta):
            return
        meta["pos"] = np.arange(self.rows, self.rows + len(meta), dtype=np.int64)
        order, bounds = partition_order(meta["h1"], self.num_shards)
        batch = pa.record_batch(columns, schema=self.schema)
        if not np.array_equal(order, np.arange(len(order))):
            if ids is not None:
                ids = gather_ids(ids, meta["tokens"], order)
            if labels is not None:
                labels = gather_ids(labels, meta["tokens"], order)
            batch, meta = batch.take(row_indices(order)), meta[order]
        self.pending.append((batch, meta, ids, bounds, labels))
        self.rows += len(meta)
        self.pending_bytes += int(meta["nbytes"].sum())
        if self.pending_bytes >= SPILL_PART_BYTES:
            self.close_part()

    def close_part(self) -> None:
        """Write the pending batches as the next spill part: plain shard by plain shard, each shard's rows of every
        pending batch in input order (one BATCH_DTYPE entry per (batch, shard) present, adjacent in the files)."""
        if not self.pending:
            return
        if self.meta is None:
            self.meta = ArrayWriter(self.work / self.meta_name, META_DTYPE)
            self.batches = ArrayWriter(self.work / self.batches_name, BATCH_DTYPE)
        if self.ids is None and self.pending[0][2] is not None:
            self.ids = ArrayWriter(self.work / self.ids_name, np_dtype(self.id_dtype))
        if self.labels is None and self.pending[0][4] is not None:
            self.labels = ArrayWriter(self.work / self.labels_name, np.dtype(np.uint8))
        counts = np.stack([np.diff(b) for _, _, _, b, _ in self.pending])  # (batch, shard) -> rows
        which_shard, which_batch = np.nonzero(counts.T)  # shard-major, batches in input order within a shard
        tok_before = [np.concatenate([[0], np.cumsum(m["tokens"])]) for _, m, _, _, _ in self.pending]
        self.parts.append(f"spill-{self.index:05d}-{len(self.parts):04d}.arrow")
        tmp = self.work / f".{self.parts[-1]}.tmp"
        index = np.zeros(len(which_shard), dtype=BATCH_DTYPE)
        index["file"] = index["segment"] = len(self.parts) - 1  # a part holds one run of input positions
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, self.schema) as writer:  # tell() places batches
            for k, (b, p) in enumerate(zip(which_batch.tolist(), which_shard.tolist())):
                batch, meta, ids, bounds, labels = self.pending[b]
                lo, hi = int(bounds[p]), int(bounds[p + 1])
                start = sink.tell()
                writer.write_batch(batch.slice(lo, hi - lo))
                index["offset"][k], index["length"][k] = start, sink.tell() - start
                index["part"][k], index["rows"][k], index["row"][k] = p, hi - lo, self.written
                self.meta.append(meta[lo:hi])
                self.written += hi - lo
                if ids is not None:
                    t0, t1 = int(tok_before[b][lo]), int(tok_before[b][hi])
                    index["tok"][k] = self.tokens
                    self.ids.append(ids[t0:t1])
                    if labels is not None:
                        self.labels.append(labels[t0:t1])
                    self.tokens += t1 - t0
        tmp.replace(self.work / self.parts[-1])
        self.batches.append(index)
        self.pending.clear()
        self.pending_bytes = 0

    @property
    def labels_file(self) -> str | None:
        """The published labels file (chats), else None."""
        return self.labels_name if self.labels is not None else None

    def abort(self) -> None:
        self.pending.clear()
        if self.parts:  # a part that failed half-written
            (self.work / f".{self.parts[-1]}.tmp").unlink(missing_ok=True)
        for w in (self.meta, self.ids, self.labels, self.batches):
            if w is not None:
                w.abort()
        self.meta = self.ids = self.labels = self.batches = None
        for p in self.parts:
            (self.work / p).unlink(missing_ok=True)

    def finish(self) -> tuple[list[str], str | None, int, str | None, str | None]:
        """(spill parts, meta file, records, ids file, batch index file), all published (and the labels file of
        chats: `labels_file`)."""
        self.close_part()
        ids = None
        if self.ids is not None:
            self.ids.publish()
            ids = self.ids_name
        if self.labels is not None:
            self.labels.publish()
        if self.meta is None:
            return self.parts, None, 0, ids, None
        self.batches.publish()
        return self.parts, self.meta_name, self.meta.publish(), ids, self.batches_name


def spill_tokenizer(job: ShardJob):
    """The job's tokenizer when it is not bytes (bytes: one token per UTF-8 byte, counted without it; the writer
    takes the ids straight from the text). Its ids are spilled once here, so no step tokenizes twice."""
    if job.tokenizer.is_bytes:
        return None
    from nightloom.tokenizer import load_tokenizer

    return load_tokenizer(job.tokenizer)
