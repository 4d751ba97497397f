"""The scan side of the quality pass (quality.py): each spilled document's filter verdict and MinHash band keys,
computed where the unit was scanned, written as the unit's `quality-NNNNN.bin` and `bands-NNNNN.bin`. With C4 on,
the spill is first rewritten with the edited documents (quality_rewrite.py), which also gives the verdicts, and
the edited texts are signed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from nightloom.sharding import filters, near_dup
from nightloom.sharding.arrays import ArrayReader, ArrayWriter
from nightloom.sharding.job import ShardJob
from nightloom.sharding.quality import QUALITY_DTYPE, bands_dtype, enabled, params
from nightloom.sharding.quality_records import RemovedSample
from nightloom.sharding.quality_rewrite import rewrite_c4
from nightloom.sharding.scan_result import ScanResult
from nightloom.sharding.spill import BATCH_DTYPE, META_DTYPE
from nightloom.sharding.write import read_spilled_batches
from nightloom.spec.quality import FILTER_NAMES

SAMPLE_CHARS = 2000  # characters of a removed document kept in the side file
SIGN_BATCH = 512  # documents signed at once (their shingles held together)


def spilled_texts(work: Path, res: ScanResult, schema: pa.Schema) -> Iterator[str]:
    """The unit's spilled texts in its row order (meta, dest and ids follow it)."""
    with ArrayReader(work / res.batches, BATCH_DTYPE) as r:
        entries = r.read(r.count)
    fds = [os.open(work / name, os.O_RDONLY) for name in res.spills]
    try:
        for e in entries[np.argsort(entries["row"], kind="stable")]:
            data = os.pread(fds[int(e["file"])], int(e["length"]), int(e["offset"]))
            for batch in read_spilled_batches(data, schema, res.spills[int(e["file"])]):
                yield from batch.column(0).to_pylist()
    finally:
        for fd in fds:
            os.close(fd)


def scan_quality(job: ShardJob, work: Path, res: ScanResult, schema: pa.Schema) -> None:
    """Filter verdicts and band keys of the unit's spilled documents, into its work files and `res`."""
    if not enabled(job) or not res.meta:
        return
    spec, nd = job.sharding.filters, job.sharding.near_dup
    codes = rewrite_c4(job, work, res, schema) if spec is not None and spec.c4 is not None else None
    signer = near_dup.Signer(params(job)) if nd is not None else None
    res.quality, res.bands = f"quality-{res.index:05d}.bin", (f"bands-{res.index:05d}.bin" if nd else None)
    out = ArrayWriter(work / res.quality, QUALITY_DTYPE)
    bands = ArrayWriter(work / res.bands, bands_dtype(nd.bands)) if nd else None
    shown: dict[str, int] = {}
    texts = spilled_texts(work, res, schema)
    with ArrayReader(work / res.meta, META_DTYPE) as r:
        pos = r.read(r.count)["pos"]  # row order -> input position, for the codes rewrite_c4 found
    row = 0
    try:
        while batch := [t for _, t in zip(range(SIGN_BATCH), texts, strict=False)]:
            rec = np.zeros(len(batch), dtype=QUALITY_DTYPE)
            rec["key"] = near_dup.content_keys(batch)
            if codes is not None:  # the filters ran on the text as read; the spill now holds the edited text
                rec["code"] = codes[pos[row : row + len(batch)]]
            row += len(batch)
            for i, text in enumerate(batch):
                why = filters.check(text, spec) if spec is not None and codes is None else None
                if why is not None:
                    rec["code"][i] = 1 + FILTER_NAMES.index(why[0])
                    if shown.get(why[0], 0) < spec.samples:
                        shown[why[0]] = shown.get(why[0], 0) + 1
                        res.removed_samples.append(
                            RemovedSample(filter=why[0], reason=why[1], text=text[:SAMPLE_CHARS])
                        )
            if signer is not None:
                keep = np.flatnonzero(rec["code"] == 0)
                sigs, has = signer.sign([batch[i] for i in keep])
                keys = np.zeros(len(batch), dtype=bands_dtype(nd.bands))
                keys["k"][keep] = near_dup.band_keys(sigs, signer.params)
                rec["has"][keep] = has
                bands.append(keys)
            out.append(rec)
        out.publish()
        if bands is not None:
            bands.publish()
    except BaseException:
        out.abort()
        if bands is not None:
            bands.abort()
        raise
