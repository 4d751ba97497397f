"""The scan's fast path: Arrow's C++ JSON/Parquet/IPC readers, hashing straight from the Arrow string buffers.

Used when the text is the key and no `dataset.keep_columns` are carried. Any doubt (a corrupt line, a null, a
non-string) raises Fallback, and the unit is scanned again on the record path (scan_records.py), which reports it
with file:line or applies `on_error=skip`: the same output either way.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from nightloom.sharding.errors import BadInputError
from nightloom.sharding.hashing import DEDUP_SEED
from nightloom.sharding.job import ShardJob
from nightloom.sharding.jsonl_pieces import line_chunks
from nightloom.sharding.sources import SourceRef, arrow_batches
from nightloom.sharding.spill import META_DTYPE, Spill, row_indices, spill_tokenizer

JSON_BLOCK = 8 * 1024 * 1024  # JSONL pieces are parsed in Arrow blocks of this size; a longer line falls back


class Fallback(Exception):
    """The fast path cannot handle this file; use the record path."""


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
    for piece in line_chunks(local, span=span):
        yield from pj.read_json(piece, read_options=read, parse_options=parse).column(0).chunks


def _text_arrays(
    local: Path, src: SourceRef, text_field: str, span: tuple[int, int] | None = None, threads: bool = True
):
    """Fast path: the text column batch by batch from Arrow's readers (raises Fallback on any doubt)."""
    try:
        if src.format == "jsonl":
            batches = _json_text_arrays(local, text_field, span, threads)
        elif src.format in ("parquet", "arrow"):
            batches = (b.column(0) for b in arrow_batches(local, src.format, [text_field]))
        else:
            raise Fallback
        for arr in _prefetched(batches):
            if arr.type not in (pa.string(), pa.large_string()) or arr.null_count:
                raise Fallback
            if isinstance(arr, pa.ChunkedArray):
                arr = arr.combine_chunks()
            arr.validate(full=True)  # Arrow's JSON reader does not check UTF-8; this does (SIMD, cheap)
            yield arr if arr.type == pa.string() else arr.cast(pa.string())  # the spill's type: no copy for JSONL
    except (pa.ArrowException, BadInputError, OSError, EOFError, UnicodeDecodeError) as err:
        raise Fallback from err


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


def scan_fast(
    local: Path, src: SourceRef, job: ShardJob, spill: Spill, span: tuple[int, int] | None = None
) -> tuple[int, int]:
    """(records, empty) via Arrow; hashes read straight from the string buffers."""
    salt = job.sharding.salt.encode("utf-8")
    xx64, xx3 = xxhash.xxh64, xxhash.xxh3_64_intdigest
    tok = spill_tokenizer(job)
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
