"""The scan's path for local plain-text files whose text is their own key (a folder of many small files)."""

from __future__ import annotations

import xxhash

from nightloom import storage
from nightloom.sharding import readahead
from nightloom.sharding.errors import bad_record_error
from nightloom.sharding.hashing import DEDUP_SEED
from nightloom.sharding.job import ShardJob
from nightloom.sharding.manifest import BadRecord
from nightloom.sharding.scan_records import RecordBuffer
from nightloom.sharding.scan_result import MAX_BAD_EXAMPLES, FileScan, ScanResult
from nightloom.sharding.sources import utf8_error


def scan_texts(job: ShardJob, sources: list[int], buf: RecordBuffer, res: ScanResult) -> None:
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
            first_bad = BadRecord(file=src.rel, line=1, reason=utf8_error(data))
            if fail:
                raise bad_record_error(src.uri, 1, first_bad.reason) from None
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
