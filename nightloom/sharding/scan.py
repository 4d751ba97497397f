"""Map step: stream one scan unit (one input file, several small ones in order, or a line-aligned byte range of a
big uncompressed JSONL file: `line_span`), hash and count every record, spill kept records to Arrow IPC parts.

One call per scan unit, independent of the others (a Prefect task; Dask/Ray can spread them). Spill parts
hold the text (and key); a META_DTYPE array file holds both hashes, tokens, bytes and input position per record;
with a tokenizer other than `bytes` an ids file holds every record's token ids (tokenized once, here: they give
the counts the balancer uses and the shard's .bin token file); the result marker is written last, so a re-run
skips files already scanned (resume). Bad records fail at once (`on_error=fail`) or are counted (`skip`).

Each batch that reaches the spill is split by plain shard (H mod N, the shard of every bucket the balancer does
not move) into one Arrow record batch per shard, listed in a BATCH_DTYPE index: a shard writer then reads its own
partition of every spill, not the whole spill once per shard (which made writing grow as shards × corpus). A
spill part (SPILL_PART_BYTES of text, held until then) is written partition-major: a plain shard's batches of the
whole part are adjacent, so a writer reads them with one read, on S3 one ranged GET, not one per batch.
Meta, ids and the placement's dest file follow the spill's row order; META_DTYPE's `pos` gives each record's
place in input order within the unit, so a writer can restore input order where partitions meet.

Two readers, same output: a fast path (Arrow's C++ JSON/Parquet/IPC readers, hashing straight from the Arrow
buffers; used when the text is the key and no `dataset.keep_columns` are carried) and the record-by-record path, which alone knows line numbers. Any
problem on the fast path (a corrupt line, a null, a non-string) restarts the file on the record path, which
then reports it with file:line or applies `on_error=skip`.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from nightloom.sharding import readahead, storage
from nightloom.sharding.arrays import ArrayWriter
from nightloom.sharding.errors import BadInputError
from nightloom.sharding.hashing import DEDUP_SEED
from nightloom.sharding.job import ShardJob
from nightloom.sharding.manifest import BadRecord
from nightloom.sharding.sources import SourceRef, _arrow_batches, _utf8_error, read_records
from nightloom.sharding.tokens import np_dtype

MAX_BAD_EXAMPLES = 10
SPILL_BATCH = 8192  # records per Arrow batch on the record path …
SPILL_BATCH_BYTES = 16 * 1024 * 1024  # … or this much text, whichever first (bounds memory for huge documents)
SPILL_PART_BYTES = 32 * 1024 * 1024  # text per spill part: what a scan holds before writing it, shard by shard
JSON_CHUNK = 16 * 1024 * 1024  # JSONL is parsed in line-aligned pieces of this size (bounded memory) …
JSON_BLOCK = 8 * 1024 * 1024  # … in Arrow blocks of this size; a longer line falls back to the record path
NEWLINE_SEARCH = 1 << 16  # the last newline of a piece is looked for here first
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


@dataclass(slots=True)
class FileScan:
    """What one input file held: the counts the manifest's per-file accounting is built from. A plain dataclass
    (pydantic still checks it inside ScanResult and the scan markers): a folder of 20k small files makes 20k of
    them, and a pydantic model cost ~2.5 µs each to build, a dataclass ~0.3."""

    source: int  # index into ShardJob.sources
    records: int = 0
    docs: int = 0  # non-empty good documents spilled (before dedup)
    empty: int = 0
    bad: int = 0
    first_bad: BadRecord | None = None

    def plus(self, later: FileScan) -> FileScan:
        """This file's counts with those of a later byte range of it (a big file is scanned in ranges)."""
        return FileScan(
            source=self.source,
            records=self.records + later.records,
            docs=self.docs + later.docs,
            empty=self.empty + later.empty,
            bad=self.bad + later.bad,
            first_bad=self.first_bad or later.first_bad,
        )


class ScanResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int  # the scan unit's index (ShardJob.units)
    files: list[FileScan] = Field(default_factory=list)  # one per source of the unit, in order
    spills: list[str] = Field(default_factory=list)  # Arrow IPC parts of kept records, in order
    meta: str | None = None  # META_DTYPE file: (h1, h2, tokens, nbytes, pos) per spilled record; None if none kept
    ids: str | None = None  # job.token_dtype file: every spilled record's token ids, back to back (not for bytes)
    batches: str | None = None  # BATCH_DTYPE file: the spill's record batches by plain shard; None if none kept
    records: int = 0  # records seen (good + empty + bad)
    docs: int = 0  # non-empty good documents spilled (before dedup)
    empty: int = 0
    bad: int = 0
    bad_examples: list[BadRecord] = Field(default_factory=list)


class _Fallback(Exception):
    """The fast path cannot handle this file; use the record path."""


def spill_schema(job: ShardJob) -> pa.Schema:
    """The shard's own column types (pa.string: batches are bounded far below 2 GiB), so the writer casts nothing."""
    fields = [pa.field(job.dataset.text_field, pa.string())]
    if job.sharding.key_field and job.sharding.key_field != job.dataset.text_field:
        fields.append(pa.field(job.sharding.key_field, pa.string()))
    fields += [pa.field(c, pa.string()) for c in job.extra_columns]  # kept verbatim; never hashed
    return pa.schema(fields)


def _key_bytes(key: object) -> bytes:
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


class _Spill:
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
        self.batches_name = f"batches-{index:05d}.bin"
        self.meta: ArrayWriter | None = None
        self.ids: ArrayWriter | None = None
        self.batches: ArrayWriter | None = None
        # batches not written yet: (record batch, its meta, its ids or None, each plain shard's [start, stop))
        self.pending: list[tuple[pa.RecordBatch, np.ndarray, np.ndarray | None, np.ndarray]] = []
        self.pending_bytes = 0
        self.rows = self.written = self.tokens = 0  # rows added (input positions), rows and ids written

    def add(self, columns: list[pa.Array], meta: np.ndarray, ids: np.ndarray | None = None) -> None:
        """`ids`: the records' token ids back to back (meta["tokens"] of them per record), or None for bytes."""
        if not len(meta):
            return
        meta["pos"] = np.arange(self.rows, self.rows + len(meta), dtype=np.int64)
        order, bounds = partition_order(meta["h1"], self.num_shards)
        batch = pa.record_batch(columns, schema=self.schema)
        if not np.array_equal(order, np.arange(len(order))):
            if ids is not None:
                ids = gather_ids(ids, meta["tokens"], order)
            batch, meta = batch.take(row_indices(order)), meta[order]
        self.pending.append((batch, meta, ids, bounds))
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
        counts = np.stack([np.diff(b) for _, _, _, b in self.pending])  # (batch, shard) -> rows
        which_shard, which_batch = np.nonzero(counts.T)  # shard-major, batches in input order within a shard
        tok_before = [np.concatenate([[0], np.cumsum(m["tokens"])]) for _, m, _, _ in self.pending]
        self.parts.append(f"spill-{self.index:05d}-{len(self.parts):04d}.arrow")
        tmp = self.work / f".{self.parts[-1]}.tmp"
        index = np.zeros(len(which_shard), dtype=BATCH_DTYPE)
        index["file"] = index["segment"] = len(self.parts) - 1  # a part holds one run of input positions
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, self.schema) as writer:  # tell() places batches
            for k, (b, p) in enumerate(zip(which_batch.tolist(), which_shard.tolist())):
                batch, meta, ids, bounds = self.pending[b]
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
                    self.tokens += t1 - t0
        tmp.replace(self.work / self.parts[-1])
        self.batches.append(index)
        self.pending.clear()
        self.pending_bytes = 0

    def abort(self) -> None:
        self.pending.clear()
        if self.parts:  # a part that failed half-written
            (self.work / f".{self.parts[-1]}.tmp").unlink(missing_ok=True)
        for w in (self.meta, self.ids, self.batches):
            if w is not None:
                w.abort()
        self.meta = self.ids = self.batches = None
        for p in self.parts:
            (self.work / p).unlink(missing_ok=True)

    def finish(self) -> tuple[list[str], str | None, int, str | None, str | None]:
        """(spill parts, meta file, records, ids file, batch index file), all published."""
        self.close_part()
        ids = None
        if self.ids is not None:
            self.ids.publish()
            ids = self.ids_name
        if self.meta is None:
            return self.parts, None, 0, ids, None
        self.batches.publish()
        return self.parts, self.meta_name, self.meta.publish(), ids, self.batches_name


def _after_newline(f, pos: int, size: int) -> int:
    """The offset just past the first newline at or after `pos` in the open file `f` (`size` if there is none)."""
    f.seek(pos)
    while pos < size:
        chunk = f.read(NEWLINE_SEARCH)
        if not chunk:
            break
        hit = chunk.find(b"\n")
        if hit >= 0:
            return pos + hit + 1
        pos += len(chunk)
    return size


def line_span(local: Path, start: int, stop: int) -> tuple[int, int]:
    """The bytes a range unit [start, stop) reads: every line that starts in it, so consecutive ranges of a file
    read each line exactly once whatever the range size (a line is in the range its first byte is in)."""
    size = local.stat().st_size
    with open(local, "rb", buffering=0) as f:
        a = 0 if start <= 0 else _after_newline(f, start - 1, size)
        b = size if stop >= size else _after_newline(f, stop - 1, size)
    return a, max(a, b)


def _line_chunks(local: Path, size: int = JSON_CHUNK, span: tuple[int, int] | None = None):
    """Line-aligned Arrow buffers of about `size` bytes (a longer line makes a longer piece), decompressing as it
    goes; only the bytes of `span` (line-aligned, of an uncompressed file) when given. Pieces are slices of what
    was read; a blank partial last line is dropped."""
    name = local.name.lower()
    comp = "gzip" if name.endswith(".gz") else "zstd" if name.endswith((".zst", ".zstd")) else None
    if comp is None:
        yield from _file_pieces(local, size, span or (0, local.stat().st_size))
    else:
        yield from _stream_pieces(pa.input_stream(str(local), compression=comp), size)


def _last_newline(data: pa.Buffer) -> int:
    """The index of the last b"\n" in `data` (its tail is searched first), or -1."""
    view = np.frombuffer(data, dtype=np.uint8)
    tail = view[-NEWLINE_SEARCH:]
    hits = np.flatnonzero(tail == 10)
    if len(hits):
        return len(view) - len(tail) + int(hits[-1])
    hits = np.flatnonzero(view == 10)
    return int(hits[-1]) if len(hits) else -1


def _file_pieces(local: Path, size: int, span: tuple[int, int]):
    """An uncompressed file's bytes [start, end): each read starts right after the last piece's newline (the
    partial line is read again: nothing is copied; joining it to the next read cost two copies of the corpus,
    under the GIL); a line longer than a read is read again, twice as far."""
    pos, end = span
    with pa.OSFile(str(local)) as f:
        n = size
        while pos < end:
            f.seek(pos)
            data = f.read_buffer(min(n, end - pos))
            last = not data.size or pos + data.size >= end
            cut = _last_newline(data)
            if cut < 0 and not last:
                n *= 2
                continue
            n = size
            if cut >= 0:
                yield data.slice(0, cut + 1)
            if last:
                tail = data.slice(cut + 1)
                if tail.size and tail.to_pybytes().strip():
                    yield tail
                return
            pos += cut + 1


def _stream_pieces(stream, size: int):
    """A compressed stream, which cannot seek: a piece's partial last line is joined to the next read."""
    with stream as f:
        rest: pa.Buffer | None = None
        while (data := f.read_buffer(size)).size:
            if rest is not None:
                data = pa.py_buffer(rest.to_pybytes() + data.to_pybytes())
            cut = _last_newline(data)
            if cut < 0:
                rest = data
                continue
            yield data.slice(0, cut + 1)
            rest = data.slice(cut + 1) if cut + 1 < data.size else None
        if rest is not None and rest.to_pybytes().strip():
            yield rest


def _prefetched(items, depth: int = 1):
    """Iterate `items` in a background thread, at most `depth` ahead: Arrow parses the next piece (GIL released)
    while this thread hashes the current one. Errors are re-raised here, in order."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((done, None))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put((done, err))

    worker = threading.Thread(target=produce, name="nightloom-scan-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item, err = q.get()
            if item is done:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # unblock a producer waiting on a full queue, then let it finish
            try:
                q.get_nowait()
            except queue.Empty:
                worker.join(0.05)


def _json_text_arrays(local: Path, text_field: str, span: tuple[int, int] | None = None, threads: bool = True):
    """The text column of JSONL, one bounded piece at a time (Arrow's streaming reader reads ahead without bound).
    `threads`: Arrow parses a piece's blocks on its CPU pool (see `parse_threads`)."""
    import pyarrow.json as pj

    read = pj.ReadOptions(block_size=JSON_BLOCK, use_threads=threads)
    parse = pj.ParseOptions(explicit_schema=pa.schema([(text_field, pa.string())]), unexpected_field_behavior="ignore")
    for piece in _line_chunks(local, span=span):
        yield from pj.read_json(piece, read_options=read, parse_options=parse).column(0).chunks


def _text_arrays(
    local: Path, src: SourceRef, text_field: str, span: tuple[int, int] | None = None, threads: bool = True
):
    """Fast path: the text column batch by batch from Arrow's readers (raises _Fallback on any doubt)."""
    try:
        if src.format == "jsonl":
            batches = _json_text_arrays(local, text_field, span, threads)
        elif src.format in ("parquet", "arrow"):
            batches = (b.column(0) for b in _arrow_batches(local, src.format, [text_field]))
        else:
            raise _Fallback
        for arr in _prefetched(batches):
            if arr.type not in (pa.string(), pa.large_string()) or arr.null_count:
                raise _Fallback
            if isinstance(arr, pa.ChunkedArray):
                arr = arr.combine_chunks()
            arr.validate(full=True)  # Arrow's JSON reader does not check UTF-8; this does (SIMD, cheap)
            yield arr if arr.type == pa.string() else arr.cast(pa.string())  # the spill's type: no copy for JSONL
    except (pa.ArrowException, BadInputError, OSError, EOFError, UnicodeDecodeError) as err:
        raise _Fallback from err


# First bytes that can start a whitespace-only document: ASCII whitespace (str.isspace: \t\n\v\f\r, \x1c-\x1f,
# space) and any non-ASCII lead byte (U+0085, U+00A0, U+3000 … are spaces too). Anything else cannot be blank.
_MAYBE_BLANK = np.zeros(256, dtype=bool)
_MAYBE_BLANK[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
_MAYBE_BLANK[0x80:] = True


def _blank_rows(offsets: np.ndarray, data: np.ndarray, mv: memoryview) -> np.ndarray:
    """Rows that are "" or whitespace only (str.isspace decides, for the few rows whose first byte allows it)."""
    lengths = np.diff(offsets)
    blank = lengths == 0
    nonempty = np.flatnonzero(~blank)
    first = data[offsets[nonempty]] if len(data) else np.zeros(0, dtype=np.uint8)
    for i in nonempty[_MAYBE_BLANK[first]].tolist():
        a, b = int(offsets[i]), int(offsets[i + 1])
        head = bytes(mv[a : min(b, a + 4)]).decode("utf-8", "ignore")[:1]
        if head and not head.isspace():
            continue  # the first character is visible: not blank (the common case for non-ASCII text)
        s = bytes(mv[a:b]).decode("utf-8")
        blank[i] = s.isspace()
    return blank


def _counter(job: ShardJob):
    """The job's tokenizer when it is not bytes (bytes: one token per UTF-8 byte, counted without it; the writer
    takes the ids straight from the text). Its ids are spilled once here, so no step tokenizes twice."""
    if job.tokenizer.is_bytes:
        return None
    from nightloom.tokenizer import load_tokenizer

    return load_tokenizer(job.tokenizer)


def _scan_fast(
    local: Path, src: SourceRef, job: ShardJob, spill: _Spill, span: tuple[int, int] | None = None
) -> tuple[int, int]:
    """(records, empty) via Arrow; hashes read straight from the string buffers."""
    salt = job.sharding.salt.encode("utf-8")
    xx64, xx3 = xxhash.xxh64, xxhash.xxh3_64_intdigest
    tok = _counter(job)
    records = empty = 0
    for arr in _text_arrays(local, src, job.dataset.text_field, span, parse_threads(job)):
        n = len(arr)
        records += n
        if not n:
            continue
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + n + 1].astype(np.int64)
        buf = arr.buffers()[2]
        mv = memoryview(buf) if buf is not None else memoryview(b"")
        data = np.frombuffer(mv, dtype=np.uint8)
        blank = _blank_rows(offsets, data, mv)
        keep = np.flatnonzero(~blank)
        empty += n - len(keep)
        if not len(keep):
            continue
        meta = np.empty(len(keep), dtype=META_DTYPE)
        starts, ends = offsets[keep].tolist(), offsets[keep + 1].tolist()
        h1, h2 = [], []
        for a, b in zip(starts, ends):
            piece = mv[a:b]
            h = xx64(piece)
            h.update(salt)
            h1.append(h.intdigest())
            h2.append(xx3(piece, seed=DEDUP_SEED))
        meta["h1"], meta["h2"] = h1, h2
        meta["tokens"] = meta["nbytes"] = np.diff(offsets)[keep]  # tokenizer "bytes": one token per UTF-8 byte
        texts = arr if len(keep) == n else arr.take(row_indices(keep))
        ids = None
        if tok is not None:
            meta["tokens"], ids = tok.encode_ids(texts.to_pylist())
        spill.add([texts], meta, ids)
    return records, empty


class _RecordBuffer:
    """Good records of the record path, batched across the files of a unit before they reach the spill (one
    small file per batch would make the writers walk thousands of tiny batches)."""

    def __init__(self, job: ShardJob, spill: _Spill):
        self.spill = spill
        self.separate_key = job.sharding.key_field is not None and job.sharding.key_field != job.dataset.text_field
        self.kept: list[list[str | None]] = [[] for _ in job.extra_columns]
        self.texts: list[bytes] = []
        self.keys: list[bytes] = []
        self.meta: list[tuple[int, int, int, int, int]] = []  # pos is set by the spill
        self.pending = 0
        self.count = 0  # documents added so far (spilled or buffered)
        self.tok = _counter(job)  # None for bytes (tokens = UTF-8 bytes, already in meta)

    def add(self, tb: bytes, kb: bytes, meta: tuple[int, int, int, int, int], extras) -> None:
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
        ids = None
        if self.tok is not None:
            meta["tokens"], ids = self.tok.encode_ids([t.decode("utf-8") for t in self.texts])
        self.spill.add(cols, meta, ids)
        self.texts.clear(), self.keys.clear(), self.meta.clear()
        for values in self.kept:
            values.clear()
        self.pending = 0


def _scan_records(
    local: Path, src: SourceRef, job: ShardJob, buf: _RecordBuffer, res: ScanResult, span: tuple[int, int] | None
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
            if fail:
                raise BadInputError(f"{src.uri}:{where}: {err}")
            res.bad += 1
            if len(res.bad_examples) < MAX_BAD_EXAMPLES:
                res.bad_examples.append(BadRecord(file=src.rel, line=where, reason=err))
            continue
        if not text or text.isspace():
            res.empty += 1
            continue
        tb = text.encode("utf-8")
        kb = tb if key is None else _key_bytes(key)
        nb = len(tb)  # tokenizer "bytes": one token per UTF-8 byte
        nb_all = nb + len(kb) if buf.separate_key else nb
        buf.add(tb, kb, (xx64(kb + salt), xx3(kb, seed=DEDUP_SEED), nb, nb_all, 0), extras)


def _plain_text(job: ShardJob, src: SourceRef) -> bool:
    """A local text file whose text is its own key (`_scan_texts` reads it)."""
    return src.format == "text" and job.sharding.key_field is None and not storage.is_s3(src.uri)


def _scan_texts(job: ShardJob, sources: list[int], buf: _RecordBuffer, res: ScanResult) -> None:
    """Local text files whose text is their own key: what the record path makes of them (one document per file,
    file:1 for a bad one), without that path's per-record machinery (generators, Path and pydantic objects per
    file), which a folder of 21k small source files spent most of its scan in."""
    salt = job.sharding.salt.encode("utf-8")
    fail = job.sharding.on_error == "fail"
    xx64, xx3 = xxhash.xxh64_intdigest, xxhash.xxh3_64_intdigest
    empty_all = bad_all = 0
    for source in sources:
        src = job.sources[source]
        data = readahead.take(src.uri, src.fingerprint)  # the plan's read of it, if this process planned
        if data is None:
            data = storage.read_whole(src.uri, src.size)
        docs = empty = bad = 0
        first_bad = None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            first_bad = BadRecord(file=src.rel, line=1, reason=_utf8_error(data))
            if fail:
                raise BadInputError(f"{src.uri}:1: {first_bad.reason}") from None
            bad = 1
            if len(res.bad_examples) < MAX_BAD_EXAMPLES:
                res.bad_examples.append(first_bad)
        else:
            if not text or text.isspace():
                empty = 1
            else:
                buf.add(data, data, (xx64(data + salt), xx3(data, seed=DEDUP_SEED), len(data), len(data), 0), ())
                docs = 1
        empty_all, bad_all = empty_all + empty, bad_all + bad
        res.files.append(FileScan(source=source, records=1, docs=docs, empty=empty, bad=bad, first_bad=first_bad))
    res.records, res.empty, res.bad = res.records + len(sources), res.empty + empty_all, res.bad + bad_all


def _scan_file(
    job: ShardJob,
    work: Path,
    source: int,
    buf: _RecordBuffer,
    res: ScanResult,
    fast: bool,
    span: tuple[int, int] | None = None,
) -> None:
    """Scan one input file (or the line-aligned byte `span` of it) into the unit's spill, adding its counts to `res`
    and its FileScan to `res.files`."""
    src = job.sources[source]
    if _plain_text(job, src):
        _scan_texts(job, [source], buf, res)
        return
    local = Path(src.uri)
    downloaded = None
    if storage.is_s3(src.uri):
        downloaded = work / "inputs" / f"{source:05d}-{Path(src.rel).name}"
        local = storage.get_file(src.uri, downloaded, job.s3)
    before = (res.records, res.empty, res.bad, len(res.bad_examples), buf.count)
    try:
        if fast:
            buf.flush()  # keep input order: buffered records of earlier files go first
            records, empty = _scan_fast(local, src, job, buf.spill, span)
            res.records, res.empty = res.records + records, res.empty + empty
            buf.count += records - empty  # the fast path spills every non-blank row
        else:
            _scan_records(local, src, job, buf, res, span)
    finally:
        if downloaded is not None:
            downloaded.unlink(missing_ok=True)
    bad = res.bad - before[2]
    first_bad = None
    if bad:
        first_bad = next((b for b in res.bad_examples[before[3] :] if b.file == src.rel), None)
        if first_bad is None:  # examples are capped; the file still names its first bad line
            first_bad = BadRecord(file=src.rel, line=0, reason="bad records (examples cap reached)")
    res.files.append(
        FileScan(
            source=source,
            records=res.records - before[0],
            docs=buf.count - before[4],
            empty=res.empty - before[1],
            bad=bad,
            first_bad=first_bad,
        )
    )


def _fast_path(job: ShardJob, src: SourceRef) -> bool:
    return src.format != "text" and job.sharding.key_field is None and not job.extra_columns


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's share, not the host's count), at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def arrow_threads_at_least(n: int) -> None:
    """Size Arrow's CPU pool (which parses JSONL) to at least `n` threads. Arrow sizes it from OMP_NUM_THREADS,
    which torchrun, CI and the Makefile set to 1 for torch's sake: that left the parse on one core (1 GiB on 2
    cores: 157 vs 172 MB/s end to end). Only ever raised, so concurrent scans cannot shrink it under each other."""
    if pa.cpu_count() < n:
        pa.set_cpu_count(n)


def parse_threads(job: ShardJob) -> bool:
    """Whether Arrow parses a JSONL piece on several threads: only when the job has fewer scan units than CPUs.
    Otherwise units already run side by side, one per CPU, and a threaded parse only adds its hand-offs and
    block-boundary work (1 GiB, 17 units, 2 CPUs: the scan 1.70-1.94 s single-threaded against 1.82-2.19 s)."""
    return len(job.units) < usable_cpus()


#: units of small text files are scanned one at a time per process: their scan is Python (GIL) bound, and two
#: threads at once only trade the GIL back and forth (20k files of 1.7 KB: 0.31 s on 2 threads, 0.24 s on one)
_TEXT_SCAN = threading.Lock()


def scan_unit(job: ShardJob, index: int) -> ScanResult:
    """Scan unit `index` of the job (its files in order, into one spill); idempotent (a finished scan is read
    back, not redone). Any doubt on the fast path rescans the whole unit on the record path (same output)."""
    wd = job.work
    marker = f"scan-{index:05d}.json"
    done = wd.marker(marker)
    if done is not None:
        return ScanResult.model_validate_json(done)
    work = wd.local
    work.mkdir(parents=True, exist_ok=True)
    arrow_threads_at_least(usable_cpus())
    sources = job.units[index]
    rng = job.unit_range(index)
    span = line_span(Path(job.sources[sources[0]].uri), *rng) if rng is not None else None
    schema = spill_schema(job)

    def spill() -> _Spill:
        return _Spill(work, index, schema, job.token_dtype, job.num_shards)

    buf, res = _RecordBuffer(job, spill()), ScanResult(index=index)
    try:
        try:
            if all(_plain_text(job, job.sources[i]) for i in sources):  # a unit of a text folder: in one go
                with _TEXT_SCAN:
                    _scan_texts(job, sources, buf, res)
            else:
                for i in sources:
                    _scan_file(job, work, i, buf, res, _fast_path(job, job.sources[i]), span)
        except _Fallback:
            buf.spill.abort()
            buf, res = _RecordBuffer(job, spill()), ScanResult(index=index)
            for i in sources:
                _scan_file(job, work, i, buf, res, False, span)
        buf.flush()
    except BaseException:
        buf.spill.abort()
        raise
    res.spills, res.meta, res.docs, res.ids, res.batches = buf.spill.finish()
    wd.publish(*res.spills, *(f for f in (res.meta, res.ids, res.batches) if f))  # files first, the marker last
    wd.write_marker(marker, res.model_dump_json().encode())
    return res
