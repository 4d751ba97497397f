"""C4's edited documents written to the shards: with `sharding.filters.c4` on, a scan unit's spill is rewritten
once, in the scan (before its marker), with every document the filter chain keeps as C4 leaves it (its kept
lines: datatrove's C4QualityFilter output text), its bytes and token ids counted again.

The unit's spill is read back a spill part at a time (a part holds one run of input positions, 32 MiB of text)
in input order and written through a new `spill.Spill` in that order, so every document keeps its input position
(`pos`), its plain shard and its exact-dedup identity (h1, h2: the text as read). Documents a filter removes keep
their text (they are dropped at place). The filters run here, once, on the text as read; their verdicts are
returned per input position for the quality scan (quality_scan.py), which then signs the edited texts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from nightloom.sharding import filters
from nightloom.sharding.arrays import ArrayReader
from nightloom.sharding.errors import ShardingError
from nightloom.sharding.job import ShardJob
from nightloom.sharding.quality_records import RemovedSample
from nightloom.sharding.scan_result import ScanResult
from nightloom.sharding.spill import BATCH_DTYPE, META_DTYPE, Spill, row_indices, spill_tokenizer
from nightloom.sharding.write import read_spilled_batches
from nightloom.spec.quality import FILTER_NAMES

REWRITE_DIR = "c4-rewrite-{:05d}"  # a unit's new spill is written here (units scan at once), then moved over the old
ADD_BATCH = 8192  # documents handed to the new spill at once
SAMPLE_CHARS = 2000  # characters of a removed document kept in the side file


def parts_in_input_order(work: Path, res: ScanResult, schema: pa.Schema) -> Iterator[tuple[pa.Table, np.ndarray]]:
    """Per spill part, its rows (all columns) and their meta, in input order."""
    with ArrayReader(work / res.batches, BATCH_DTYPE) as r:
        entries = r.read(r.count)
    with ArrayReader(work / res.meta, META_DTYPE) as r:
        meta = r.read(r.count)
    for f, name in enumerate(res.spills):
        batches, rows = [], []
        fd = os.open(work / name, os.O_RDONLY)
        try:
            for e in entries[entries["file"] == f]:
                batches += read_spilled_batches(os.pread(fd, int(e["length"]), int(e["offset"])), schema, name)
                rows.append(np.arange(int(e["row"]), int(e["row"]) + int(e["rows"])))
        finally:
            os.close(fd)
        m = meta[np.concatenate(rows)] if rows else meta[:0]
        order = np.argsort(m["pos"], kind="stable")
        yield pa.Table.from_batches(batches, schema=schema).take(row_indices(order)), m[order]


def rewrite_c4(job: ShardJob, work: Path, res: ScanResult, schema: pa.Schema) -> np.ndarray:
    """Rewrite the unit's spill with the chain's edited texts (see the module); the filters' codes per input
    position (0 kept, 1 + index in FILTER_NAMES); the first removed documents per filter go to `res`."""
    spec, tok = job.sharding.filters, spill_tokenizer(job)
    codes = np.zeros(res.docs, dtype=np.uint8)
    shown: dict[str, int] = {}
    folder = work / REWRITE_DIR.format(res.index)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    new = Spill(folder, res.index, schema, job.token_dtype, job.num_shards)
    try:
        for table, meta in parts_in_input_order(work, res, schema):
            for lo in range(0, len(meta), ADD_BATCH):
                m = meta[lo : lo + ADD_BATCH].copy()
                texts = []
                for pos, text in zip(m["pos"].tolist(), table.column(0).slice(lo, len(m)).to_pylist(), strict=True):
                    why, out = filters.check_edit(text, spec)
                    texts.append(out)
                    if why is not None:
                        codes[pos] = 1 + FILTER_NAMES.index(why[0])
                        if shown.get(why[0], 0) < spec.samples:
                            shown[why[0]] = shown.get(why[0], 0) + 1
                            res.removed_samples.append(
                                RemovedSample(filter=why[0], reason=why[1], text=text[:SAMPLE_CHARS])
                            )
                encoded = [t.encode("utf-8") for t in texts]
                m["nbytes"] = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
                ids = None
                if tok is None:
                    m["tokens"] = m["nbytes"]  # bytes: one token per UTF-8 byte
                else:
                    m["tokens"], ids = tok.encode_ids(texts)
                cols = [pa.array(texts, type=pa.string())]
                cols += [table.column(c).slice(lo, len(m)).combine_chunks() for c in range(1, table.num_columns)]
                if not np.array_equal(m["pos"], np.arange(new.rows, new.rows + len(m))):  # add() numbers them so
                    raise ShardingError(f"internal: unit {res.index}'s spill is not positions 0..n-1 in order")
                new.add(cols, m, ids)
        spills, meta_name, docs, ids_name, batches = new.finish()
    except BaseException:
        new.abort()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    for old in [*res.spills, res.meta, res.ids, res.batches]:
        if old:
            (work / old).unlink(missing_ok=True)
    for name in [*spills, meta_name, ids_name, batches]:
        if name:
            os.replace(folder / name, work / name)
    shutil.rmtree(folder, ignore_errors=True)
    res.spills, res.meta, res.docs, res.ids, res.batches = spills, meta_name, docs, ids_name, batches
    return codes
