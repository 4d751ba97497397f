"""What the scan step hands on: per unit a ScanResult (its work files and counts), per input file a FileScan (the
counts the manifest's per-file accounting is built from).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from nightloom.records import Record
from nightloom.sharding.manifest import BadRecord
from nightloom.sharding.quality_records import RemovedSample

MAX_BAD_EXAMPLES = 10


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


class ScanResult(Record):
    """One scan unit's result: its work files (spill parts, meta, ids, batch index) and what its files held."""

    index: int  # the scan unit's index (ShardJob.units)
    files: list[FileScan] = Field(default_factory=list)  # one per source of the unit, in order
    spills: list[str] = Field(default_factory=list)  # Arrow IPC parts of kept records, in order
    meta: str | None = None  # META_DTYPE file: (h1, h2, tokens, nbytes, pos) per spilled record; None if none kept
    ids: str | None = None  # job.token_dtype file: every spilled record's token ids, back to back (not for bytes)
    batches: str | None = None  # BATCH_DTYPE file: the spill's record batches by plain shard; None if none kept
    labels: str | None = None  # chats: uint8 file, a 0/1 label per id of `ids` (aligned); else None
    records: int = 0  # records seen (good + empty + bad)
    docs: int = 0  # non-empty good documents spilled (before dedup)
    empty: int = 0
    bad: int = 0
    bad_examples: list[BadRecord] = Field(default_factory=list)
    chats_cut: int = 0  # chats: conversations cut at a turn boundary to fit seq_len + 1 ids
    chats_dropped: int = 0  # chats: conversations with no run of whole turns that fits (not spilled)
    # sharding.filters / near_dup (quality_scan.py): per spilled record its verdict, and its band keys
    quality: str | None = None
    bands: str | None = None
    removed_samples: list[RemovedSample] = Field(default_factory=list)  # the first few per filter
