"""Write step: one Parquet shard and its token files (.bin/.idx) from the spills, in input order.

Row groups are cut after 16 MiB of text or 65,536 rows, counted over the shard's own row sequence, so the
bytes depend only on the data and settings, never on how inputs were split across workers. The token files
(nightloom/sharding/tokens.py) hold the same documents in the same order: ids from the scan's id spill, or for
the `bytes` tokenizer the text's UTF-8 bytes. Each file is published with os.replace (local) or a multipart
upload (S3), token files first, the Parquet shard last, then the marker: a shard appears complete or not at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nightloom import storage
from nightloom.sharding.arrays import DEST_DTYPE, ArrayReader
from nightloom.sharding.directio import DirectWriter
from nightloom.sharding.errors import ShardingError
from nightloom.sharding.fetch_ahead import ordered_ahead
from nightloom.sharding.job import ShardJob
from nightloom.sharding.manifest import ShardInfo, TokenFiles
from nightloom.sharding.place import MAPPING_NAME, dest_name
from nightloom.sharding.prepare import RANGE_BYTES
from nightloom.sharding.scan_result import ScanResult
from nightloom.sharding.spill import BATCH_DTYPE, META_DTYPE, gather_ids, row_indices, spill_schema
from nightloom.sharding.tokens import LABEL_DTYPE, TokenCounts, TokenFileWriter, labels_file_name, np_dtype
from nightloom.sharding.workdir import WorkDir
from nightloom.sharding.writeback import durable_and_uncached

ROW_GROUP_BYTES = 16 * 1024 * 1024
ROW_GROUP_ROWS = 65_536
SINK_BUFFER = 1 << 20
READ_AHEAD = 8  # scan units a writer reads ahead on an S3 work folder (their ranged GETs in flight)


def parquet_options(compression: str) -> dict:
    """Writer settings: no dictionary or statistics (free text gains nothing from them); zstd at level 1 is
    the fastest zstd and still shrinks text ~2.5× (bench/sharding.py prints what each codec costs)."""
    opts: dict = {"use_dictionary": False, "write_statistics": False, "compression": compression}
    if compression == "zstd":
        opts["compression_level"] = 1
    return opts


def _output_columns(job: ShardJob) -> list[str]:
    cols = [job.dataset.text_field]
    if job.sharding.key_field and job.sharding.key_field != job.dataset.text_field:
        cols.append(job.sharding.key_field)
    return cols + list(job.extra_columns)


def _cut(nbytes: np.ndarray) -> int:
    """Rows in the next row group of a pending buffer (0 = keep buffering)."""
    if len(nbytes) >= ROW_GROUP_ROWS:
        hit = np.searchsorted(np.cumsum(nbytes[:ROW_GROUP_ROWS]), ROW_GROUP_BYTES)
        return int(min(hit + 1, ROW_GROUP_ROWS))
    csum = np.cumsum(nbytes)
    if len(csum) and csum[-1] >= ROW_GROUP_BYTES:
        return int(np.searchsorted(csum, ROW_GROUP_BYTES) + 1)
    return 0


def partitions_of(mapping: np.ndarray, index: int, num_shards: int, heldout: bool) -> np.ndarray:
    """The plain shards whose spill partitions hold rows of shard `index` (the held-out split: all of them)."""
    if heldout:
        return np.arange(num_shards)
    return np.unique(np.flatnonzero(mapping == index) % num_shards)


def _segments(entries: np.ndarray):
    """The batch index entries grouped by segment, in order."""
    if len(entries):
        cut = np.flatnonzero(np.diff(entries["segment"])) + 1
        yield from np.split(entries, cut)


def _runs(entries: np.ndarray) -> list[tuple[int, int, int, int, int, int, bool]]:
    """`entries` (of one segment) as runs that are adjacent in their spill part, and so in the meta, dest and ids
    files, each read with one read of each file (on S3, one ranged GET): (spill part, byte offset, bytes, first
    row, rows, first id, whether it spans several plain shards). Plain Python: a run is usually one entry, and a
    big corpus has units × shards of them, where numpy's per-call cost showed (0.02 ms a (unit, shard) pair)."""
    runs: list[list] = []
    for file, part, offset, length, _, rows, row, tok in entries.tolist():
        last = runs[-1] if runs else None
        if last is not None and last[0] == file and last[1] + last[2] == offset:
            last[2] += length
            last[4] += rows
            last[6] = last[6] or part != last[7]
        else:
            runs.append([file, offset, length, row, rows, tok, False, part])
    return [tuple(r[:7]) for r in runs]


class _WorkFile:
    """A work file of one scan, read by byte range: os.pread on this machine's copy, or one ranged GET on an S3
    work folder this machine has no copy of. A writer reads a few slices of each scan's files, so opening one costs
    a descriptor, not an IPC footer or an np.memmap (~80 µs a map)."""

    def __init__(self, wd: WorkDir, name: str):
        self.name = name
        self.remote = wd.ranged(name)
        self.fd = os.open(wd.path(name), os.O_RDONLY) if self.remote is None else None

    def read(self, offset: int, length: int) -> bytes:
        data = self.remote.read_at(offset, length) if self.fd is None else os.pread(self.fd, length, offset)
        if len(data) != length:
            raise ShardingError(f"{self.name}: wanted bytes {offset}+{length}, the file ended after {len(data)}")
        return data

    def records(self, dtype: np.dtype, start: int, n: int) -> np.ndarray:
        """Records [start, start + n) of a fixed-dtype array file (read-only)."""
        return np.frombuffer(self.read(start * dtype.itemsize, n * dtype.itemsize), dtype=dtype)

    def batches(self, offset: int, length: int, schema: pa.Schema) -> list[pa.RecordBatch]:
        """The spilled record batches in this byte range of a spill part (a run of batch index entries)."""
        return read_spilled_batches(self.read(offset, length), schema, f"{self.name} bytes {offset}+{length}")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_spilled_batches(data: bytes, schema: pa.Schema, where: str) -> list[pa.RecordBatch]:
    """The record batches in `data`, a byte range of an Arrow IPC file that holds whole batches (the first of a
    file also holds its magic and schema message, which are skipped). They refer to `data`, a copy: not to the
    file."""
    buf = pa.py_buffer(data)
    if data[:6] == b"ARROW1":
        buf = buf.slice(8)  # the file format's magic and padding, then the stream (schema message first)
    out = [
        pa.ipc.read_record_batch(message, schema)
        for message in pa.ipc.MessageReader.open_stream(pa.BufferReader(buf))
        if message.type == "record batch"
    ]
    if not out:
        raise ShardingError(f"internal: no record batch in {where}")
    return out


def _merged(pieces: list, mixed: bool, has_ids: bool, has_labels: bool):
    """One segment's pieces (table, meta, ids, labels) as one, in input order (by `pos`) where partitions met."""
    if len(pieces) == 1:
        t, m, ids, labels = pieces[0]
    else:
        t = pa.concat_tables([p[0] for p in pieces])
        m = np.concatenate([p[1] for p in pieces])
        ids = np.concatenate([p[2] for p in pieces]) if has_ids else None
        labels = np.concatenate([p[3] for p in pieces]) if has_labels else None
    if mixed or len(pieces) > 1:  # partitions met: input order back
        order = np.argsort(m["pos"], kind="stable")
        if ids is not None:
            ids = gather_ids(ids, m["tokens"], order)
        if labels is not None:
            labels = gather_ids(labels, m["tokens"], order)
        t, m = t.take(row_indices(order)), m[order]
    return t, m, ids, labels


def _rows_of_shard(
    wd: WorkDir, s: ScanResult, index: int, wanted: np.ndarray, schema: pa.Schema, cols: list[str], id_dtype: str
):
    """(shard `index`'s rows of scan `s` as a table, their META_DTYPE records, their token ids back to back or
    None when the scan spilled none, their labels aligned with the ids or None unless chats), segment by segment,
    in input order. Only the batches of the spill partitions
    marked in `wanted` (a bool per plain shard) are read, a run of adjacent ones at a time (a plain shard's batches
    of a whole spill part are adjacent), with plain reads of the spill, meta, dest and ids files: what a batch
    holds is copied, so nothing refers to the files; on an S3 work folder this machine did not scan, the reads are
    ranged GETs, so no machine downloads a scan's per-row files whole. Where several partitions meet in a
    segment, their rows are put back in input order by `pos`.

    Called once per (scan unit, shard): a big corpus has thousands of units, so what each call costs before its
    first row counts (a lookup table, not np.isin; byte ranges read from `_WorkFile`s: no np.memmap, no IPC
    footer)."""
    work = wd.local
    with ArrayReader(work / s.batches, BATCH_DTYPE) as listing:  # filtered a chunk at a time: bounded memory
        entries = np.concatenate([c[wanted[c["part"]]] for c in listing.chunks()] or [listing.read(0)])
    if not len(entries):
        return
    current: list = [None, None]  # (spill part index, its _WorkFile): one open spill part at a time
    opened: list[_WorkFile] = []
    id_type = np_dtype(id_dtype)

    def spilled(file: int, offset: int, length: int) -> list[pa.RecordBatch]:
        if current[0] != file:  # entries are in file order: a part is done once the next one starts
            if current[1] is not None:
                current[1].close()
            current[:] = [file, _WorkFile(wd, s.spills[file])]
        return current[1].batches(offset, length, schema)

    def work_file(name: str) -> _WorkFile:
        opened.append(_WorkFile(wd, name))
        return opened[-1]

    try:
        dest, meta = work_file(dest_name(s.index)), work_file(s.meta)
        ids_all = work_file(s.ids) if s.ids else None  # None: the scan spilled no ids (the bytes tokenizer)
        labels_all = work_file(s.labels) if s.labels else None  # chats only
        for seg in _segments(entries):
            pieces = []
            mixed = False  # rows of several plain shards: input order is restored below
            for file, offset, length, row, n, tok, several in _runs(seg):
                mine = dest.records(DEST_DTYPE, row, n) == index
                if not mine.any():
                    continue
                t = pa.Table.from_batches(spilled(file, offset, length), schema)
                if len(t) != n:
                    raise ShardingError(f"internal: {s.spills[file]} holds {len(t)} rows at {offset}, its index {n}")
                m = meta.records(META_DTYPE, row, n)
                ids = ids_all.records(id_type, tok, int(m["tokens"].sum())) if ids_all else None
                labels = labels_all.records(LABEL_DTYPE, tok, int(m["tokens"].sum())) if labels_all else None
                mixed = mixed or several
                if not mine.all():
                    keep = np.flatnonzero(mine)
                    if ids is not None:
                        ids = ids[np.repeat(mine, m["tokens"])]
                    if labels is not None:
                        labels = labels[np.repeat(mine, m["tokens"])]
                    t, m = t.take(row_indices(keep)), m[keep]
                pieces.append((t, m, ids, labels))
            if not pieces:
                continue
            t, m, ids, labels = _merged(pieces, mixed, ids_all is not None, labels_all is not None)
            yield t.select(cols), m, ids, labels
    finally:  # whatever failed to open or read: nothing stays open
        for f in [*opened, current[1]]:
            if f is not None:
                f.close()


class _RowGroups:
    """The shard's Parquet row groups: rows are added as they are read and written a full row group at a time
    (ROW_GROUP_ROWS or ROW_GROUP_BYTES, cut by `_cut`); the writer opens on the first group."""

    def __init__(self, stream, schema: pa.Schema, compression) -> None:
        self.stream, self.schema, self.compression = stream, schema, compression
        self.pending: list[pa.Table] = []  # rows taken for this shard, not yet written
        self.pending_nb: list[np.ndarray] = []
        self.rows = self.bytes = 0
        self.writer = None

    def add(self, t: pa.Table, nb: np.ndarray) -> None:
        self.pending.append(t)
        self.pending_nb.append(nb)
        self.rows += len(nb)
        self.bytes += int(nb.sum())
        if self.rows >= ROW_GROUP_ROWS or self.bytes >= ROW_GROUP_BYTES:
            self.emit(final=False)

    def _open(self) -> None:
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.stream, self.schema, **parquet_options(self.compression))

    def emit(self, final: bool) -> None:
        """Write every full row group of the pending rows (and, when final, the rest as the last one)."""
        buf, nb = pa.concat_tables(self.pending), np.concatenate(self.pending_nb)
        while len(nb):
            k = _cut(nb) or (len(nb) if final else 0)
            if not k:
                break
            self._open()
            self.writer.write_table(buf.slice(0, k).combine_chunks(), row_group_size=k)
            buf, nb = buf.slice(k), nb[k:]
        self.pending[:], self.pending_nb[:] = ([buf], [nb]) if len(nb) else ([], [])
        self.rows, self.bytes = len(nb), int(nb.sum())

    def close(self) -> None:
        """The last row group and the footer; an empty shard is still a valid Parquet file with the schema."""
        if self.pending:
            self.emit(final=True)
        self._open()
        self.writer.close()
        self.writer = None

    def abort(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()


def _shares(job: ShardJob, scans: list[ScanResult], index: int, wanted: np.ndarray, schema: pa.Schema, cols):
    """Each scan unit's rows for shard `index`, in unit order. On S3 each unit's share is a few ranged GETs that
    mostly wait their round trip: the next units' are read while this one is written (at most
    min(READ_AHEAD, shards) of them: a share is about a unit's 1/N)."""
    wd = job.work

    def share_of(s: ScanResult):
        """Scan `s`'s rows for this shard, read as they are asked for: its batch index whole, then its spills, meta,
        dest and ids by the run of batches (ranged GETs on an S3 work folder)."""
        wd.fetch(s.batches)
        return _rows_of_shard(wd, s, index, wanted, schema, cols, job.token_dtype)

    ahead = min(READ_AHEAD, job.num_shards) if wd.remote else 1
    return ordered_ahead(
        [s for s in sorted(scans, key=lambda s: s.index) if s.spills],
        lambda s: list(share_of(s)),
        share_of,
        ahead,
        eager=lambda s: job.unit_bytes(s.index) <= RANGE_BYTES,  # a bigger unit (a .gz file) is streamed
    )


def _token_files(
    job: ShardJob, bin_name: str, idx_name: str, labels_name: str | None, counts: TokenCounts
) -> TokenFiles:
    """The manifest's record of a shard's token files (and labels file, chats only; a pretraining shard's counts
    hold no labels, the fields' defaults)."""
    return TokenFiles(
        bin=bin_name, idx=idx_name, labels=labels_name, dtype=job.token_dtype, eos_id=job.eos_id, **asdict(counts)
    )


def _check_counts(counts, bin_name: str, rows: int, tokens: int, eos: int) -> None:
    """The token files hold the shard's documents and ids (+ one EOS each; chats end as their template ends them,
    nightloom/chat.py, so eos is 0 there)."""
    if counts.documents != rows or counts.tokens != tokens + eos:
        raise ShardingError(
            f"internal: {bin_name} holds {counts.documents} documents and {counts.tokens} ids, the shard "
            f"{rows} documents of {tokens} tokens (+{eos} EOS)"
        )


def write_shard(job: ShardJob, scans: list[ScanResult], index: int) -> ShardInfo:
    """Write shard `index`; idempotent (a published shard with its marker is not rewritten)."""
    wd = job.work
    marker = f"shard-{index:05d}.json"
    name = job.shard_name(index)
    final = storage.join(job.output, name)
    stem = job.shard_stem(index)
    bin_name, idx_name = f"{stem}.bin", f"{stem}.idx"
    labels_name = labels_file_name(stem) if job.chat is not None else None
    done = wd.marker(marker)
    if done is not None and storage.exists(final, job.s3):  # the Parquet shard is published after its token files
        return ShardInfo.model_validate_json(done)
    work = wd.local
    wd.fetch(MAPPING_NAME)  # what other machines scanned and placed (an S3 work folder; cached per machine)
    mapping = np.fromfile(work / MAPPING_NAME, dtype=DEST_DTYPE)
    wanted = np.zeros(job.num_shards, dtype=bool)  # the plain shards (spill partitions) holding this shard's rows
    wanted[partitions_of(mapping, index, job.num_shards, index == job.heldout_index)] = True
    cols = _output_columns(job)
    schema = spill_schema(job)
    local_out = not storage.is_s3(job.output)
    tmp_dir = Path(job.output) if local_out else work
    tmp = tmp_dir / f".{name}.tmp"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    bin_tmp, idx_tmp = tmp_dir / f".{bin_name}.tmp", tmp_dir / f".{idx_name}.tmp"
    labels_tmp = tmp_dir / f".{labels_name}.tmp" if labels_name else None
    sink = DirectWriter(tmp, digest=hashlib.sha256())  # hashed as written: never read back
    try:
        tokens_out = TokenFileWriter(
            bin_tmp, work / f"lengths-{index:05d}.bin", job.token_dtype, job.eos_id, labels_tmp=labels_tmp
        )
    except BaseException:
        sink.abort()
        raise
    # Arrow gathers the Parquet writer's many small writes (page headers) into 1 MiB ones before they reach Python
    stream = pa.BufferedOutputStream(pa.PythonFile(sink, mode="w"), SINK_BUFFER)
    rows = tokens = nbytes = 0
    out_schema = pa.schema([(c, pa.string()) for c in cols])
    groups = _RowGroups(stream, out_schema, job.sharding.compression)
    shares = _shares(job, scans, index, wanted, schema, cols)
    try:
        for share in shares:
            for t, sel, ids, labels in share:
                if t.schema != out_schema:
                    t = t.cast(out_schema)
                if ids is None:  # bytes: the ids are the text's UTF-8 bytes
                    tokens_out.add_texts(t.column(0))
                else:
                    tokens_out.add(sel["tokens"], ids, labels)
                rows += len(sel)
                tokens += int(sel["tokens"].sum())
                nbytes += int(sel["nbytes"].sum())
                groups.add(t, sel["nbytes"])
        groups.close()
        stream.flush()
        sink.close()
        digest = sink.digest.hexdigest()
        counts = tokens_out.finish(idx_tmp)
        _check_counts(counts, bin_name, rows, tokens, 0 if labels_tmp else rows)
        for done_file in (idx_tmp, bin_tmp, tmp, *([labels_tmp] if labels_tmp else [])):
            durable_and_uncached(done_file)
        if labels_tmp:
            storage.put_file(labels_tmp, storage.join(job.output, labels_name), job.s3)
        storage.put_file(idx_tmp, storage.join(job.output, idx_name), job.s3)
        storage.put_file(bin_tmp, storage.join(job.output, bin_name), job.s3)
        storage.put_file(tmp, final, job.s3)
    finally:
        shares.close()  # read-ahead threads stopped, work not started cancelled
        sink.abort()  # closes the file if still open and removes the temp path (gone already once published)
        groups.abort()  # after the sink's abort: what it still flushes is dropped
        tokens_out.abort()
        for t in (tmp, bin_tmp, idx_tmp, *([labels_tmp] if labels_tmp else [])):
            t.unlink(missing_ok=True)
    token_files = _token_files(job, bin_name, idx_name, labels_name, counts)
    info = ShardInfo(
        index=index, path=name, rows=rows, tokens=tokens, bytes=nbytes, sha256=digest, token_files=token_files
    )
    wd.write_marker(marker, info.model_dump_json().encode())
    return info
