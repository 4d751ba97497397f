"""Map step: stream one input file, hash and count every record, spill kept records to an Arrow IPC file.

One call per input file, independent of the others (a Prefect task; Dask/Ray can spread them). The spill
holds text, key, both hashes, tokens and bytes; the result marker is written last, so a re-run skips files
already scanned (resume). Bad records fail at once (`on_error=fail`) or are counted (`skip`).
"""

from __future__ import annotations

from pathlib import Path

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
SPILL_BATCH = 8192
SPILL_SCHEMA_META = [("h1", pa.uint64()), ("h2", pa.uint64()), ("tokens", pa.int64()), ("nbytes", pa.int64())]


class ScanResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int
    spill: str | None = None  # Arrow IPC file of kept records; None when the file had none
    records: int = 0  # records seen (good + empty + bad)
    docs: int = 0  # non-empty good documents spilled (before dedup)
    empty: int = 0
    bad: int = 0
    bad_examples: list[BadRecord] = Field(default_factory=list)


def spill_schema(job: ShardJob) -> pa.Schema:
    fields = [pa.field(job.dataset.text_field, pa.string())]
    if job.sharding.key_field and job.sharding.key_field != job.dataset.text_field:
        fields.append(pa.field(job.sharding.key_field, pa.string()))
    return pa.schema(fields + [pa.field(n, t) for n, t in SPILL_SCHEMA_META])


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
    schema = spill_schema(job)
    res = ScanResult(index=index)
    cols: dict[str, list] = {n: [] for n in schema.names}
    spill = work / f"spill-{index:05d}.arrow"
    tmp = work / f".spill-{index:05d}.arrow.tmp"
    work.mkdir(parents=True, exist_ok=True)
    writer = None

    def flush() -> None:
        nonlocal writer
        if writer is None:
            writer = pa.ipc.new_file(str(tmp), schema)
        writer.write_batch(pa.record_batch([pa.array(cols[n], type=f.type) for n, f in zip(schema.names, schema)],
                                           schema=schema))
        for v in cols.values():
            v.clear()

    c_text, c_h1, c_h2, c_tok, c_nb = cols[text_field], cols["h1"], cols["h2"], cols["tokens"], cols["nbytes"]
    c_key = cols[key_field] if separate_key else None
    try:
        for where, text, key, err in read_records(local, src.format, text_field, key_field):
            res.records += 1
            if err is not None:
                if fail:
                    raise BadInputError(f"{src.uri}:{where}: {err}")
                res.bad += 1
                if len(res.bad_examples) < MAX_BAD_EXAMPLES:
                    res.bad_examples.append(BadRecord(file=src.rel, line=where, reason=err))
                continue
            if not text.strip():
                res.empty += 1
                continue
            tb = text.encode("utf-8")
            kb = tb if key is None else _key_bytes(key)
            c_text.append(text)
            c_h1.append(xx64(kb + salt))
            c_h2.append(xx3(kb, seed=DEDUP_SEED))
            c_tok.append(len(tb))  # tokenizer "bytes": one token per UTF-8 byte
            if c_key is not None:
                ks = key if isinstance(key, str) else kb.decode("utf-8")
                c_key.append(ks)
                c_nb.append(len(tb) + len(kb))
            else:
                c_nb.append(len(tb))
            res.docs += 1
            if len(c_text) >= SPILL_BATCH:
                flush()
        if c_text:
            flush()
        if writer is not None:
            writer.close()
            writer = None
            tmp.replace(spill)
            res.spill = spill.name
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
        if downloaded is not None:
            downloaded.unlink(missing_ok=True)
    storage.write_bytes(marker, res.model_dump_json().encode())
    return res
