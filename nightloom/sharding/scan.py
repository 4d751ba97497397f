"""Map step: stream one input file, hash and count every record, spill kept records to an Arrow IPC file.

One call per input file, independent of the others (a Prefect task; Dask/Ray can spread them). The spill
parts hold text (and key); a .npy holds both hashes, tokens and bytes per record; the result marker is written last, so a re-run skips files
already scanned (resume). Bad records fail at once (`on_error=fail`) or are counted (`skip`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from nightloom.sharding import storage
from nightloom.sharding.errors import BadInputError
from nightloom.sharding.hashing import DEDUP_SEED
from nightloom.sharding.job import ShardJob
from nightloom.sharding.manifest import BadRecord
from nightloom.sharding.sources import read_records

MAX_BAD_EXAMPLES = 10
SPILL_BATCH = 8192  # records per Arrow batch …
SPILL_BATCH_BYTES = 16 * 1024 * 1024  # … or this much text, whichever first (bounds memory for huge documents)
SPILL_PART_BYTES = 64 * 1024 * 1024  # a new spill file after this much: bounds what a writer maps at once


class ScanResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int
    spills: list[str] = Field(default_factory=list)  # Arrow IPC parts of kept records, in order (≤ SPILL_PART_BYTES)
    meta: str | None = None  # .npy of (h1, h2, tokens, nbytes) per spilled record; None when nothing was kept
    records: int = 0  # records seen (good + empty + bad)
    docs: int = 0  # non-empty good documents spilled (before dedup)
    empty: int = 0
    bad: int = 0
    bad_examples: list[BadRecord] = Field(default_factory=list)


META_DTYPE = np.dtype([("h1", "<u8"), ("h2", "<u8"), ("tokens", "<i8"), ("nbytes", "<i8")])


def spill_schema(job: ShardJob) -> pa.Schema:
    fields = [pa.field(job.dataset.text_field, pa.large_string())]
    if job.sharding.key_field and job.sharding.key_field != job.dataset.text_field:
        fields.append(pa.field(job.sharding.key_field, pa.large_string()))
    return pa.schema(fields)


def _key_bytes(key: object) -> bytes:
    if isinstance(key, str):
        return key.encode("utf-8")
    return orjson.dumps(key, option=orjson.OPT_SORT_KEYS)


def scan_source(job: ShardJob, index: int) -> ScanResult:
    """Scan input `index` of the job; idempotent (a finished scan is read back, not redone)."""
    job.configure()
    work = Path(job.workdir)
    marker = work / f"scan-{index:05d}.json"
    if marker.is_file():
        return ScanResult.model_validate_json(marker.read_bytes())
    src = job.sources[index]
    local = Path(src.uri)
    downloaded = None
    if storage.is_s3(src.uri):
        downloaded = work / "inputs" / f"{index:05d}-{Path(src.rel).name}"
        local = storage.get_file(src.uri, downloaded)
    text_field, key_field = job.dataset.text_field, job.sharding.key_field
    separate_key = key_field is not None and key_field != text_field
    salt = job.sharding.salt.encode("utf-8")
    fail = job.sharding.on_error == "fail"
    xx64, xx3 = xxhash.xxh64_intdigest, xxhash.xxh3_64_intdigest
    schema = pa.schema([f for f in spill_schema(job)])
    work.mkdir(parents=True, exist_ok=True)
    records = docs = empty = bad = 0
    examples: list[BadRecord] = []
    texts: list[bytes] = []
    keys: list[bytes] = []
    meta: list[tuple[int, int, int, int]] = []
    batch_meta: list[tuple[int, int, int, int]] = []
    pending = 0
    parts: list[str] = []
    state = {"writer": None, "part_bytes": 0}

    def strings(values: list[bytes]) -> pa.Array:
        """A UTF-8 string array straight from encoded bytes (no Python str round trip)."""
        lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return pa.LargeStringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(b"".join(values)))

    def flush() -> None:
        if state["writer"] is None:
            name = f"spill-{index:05d}-{len(parts):04d}.arrow"
            parts.append(name)
            state["writer"] = pa.ipc.new_file(str(work / f".{name}.tmp"), schema)
        cols = [strings(texts)] + ([strings(keys)] if separate_key else [])
        state["writer"].write_batch(pa.record_batch(cols, schema=schema))
        state["part_bytes"] += sum(m[3] for m in batch_meta)
        meta.extend(batch_meta)
        texts.clear(), keys.clear(), batch_meta.clear()
        if state["part_bytes"] >= SPILL_PART_BYTES:
            close_part()

    def close_part() -> None:
        if state["writer"] is not None:
            state["writer"].close()
            name = parts[-1]
            (work / f".{name}.tmp").replace(work / name)
            state["writer"], state["part_bytes"] = None, 0

    try:
        for where, text, key, err in read_records(local, src.format, text_field, key_field):
            records += 1
            if err is not None:
                if fail:
                    raise BadInputError(f"{src.uri}:{where}: {err}")
                bad += 1
                if len(examples) < MAX_BAD_EXAMPLES:
                    examples.append(BadRecord(file=src.rel, line=where, reason=err))
                continue
            if not text or text.isspace():
                empty += 1
                continue
            tb = text.encode("utf-8")
            kb = tb if key is None else _key_bytes(key)
            texts.append(tb)
            nb = len(tb)  # tokenizer "bytes": one token per UTF-8 byte
            if separate_key:
                keys.append(kb)
                batch_meta.append((xx64(kb + salt), xx3(kb, seed=DEDUP_SEED), nb, nb + len(kb)))
                pending += nb + len(kb)
            else:
                batch_meta.append((xx64(kb + salt), xx3(kb, seed=DEDUP_SEED), nb, nb))
                pending += nb
            if len(texts) >= SPILL_BATCH or pending >= SPILL_BATCH_BYTES:
                flush()
                pending = 0
        if texts:
            flush()
        close_part()
        docs = len(meta)
        meta_name = None
        if meta:
            meta_name = f"meta-{index:05d}.npy"
            tmp = work / f".{meta_name}.tmp"
            with open(tmp, "wb") as f:
                np.save(f, np.array(meta, dtype=META_DTYPE))
            tmp.replace(work / meta_name)
    finally:
        if state["writer"] is not None:
            state["writer"].close()
            (work / f".{parts[-1]}.tmp").unlink(missing_ok=True)
        if downloaded is not None:
            downloaded.unlink(missing_ok=True)
    res = ScanResult(index=index, spills=parts, meta=meta_name, records=records, docs=docs, empty=empty, bad=bad,
                     bad_examples=examples)
    storage.write_bytes(marker, res.model_dump_json().encode())
    return res
