"""Every input file accounted for: read, empty, bad, duplicate, or ignored by name; the counts add up.

A file is `read` when at least one of its documents is in a shard; `duplicate` when it had documents and every
one was an exact duplicate of an earlier one; `bad` when it had no good document and at least one bad record
(its first bad line is kept); `empty` otherwise (zero bytes, blank lines, whitespace-only text).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nightloom.records import Record
from nightloom.sharding.manifest import BadRecord, SourceFile

FileStatus = Literal["read", "empty", "bad", "duplicate", "filtered"]
EXAMPLES = 10


class FileCounts(Record):
    """How many input files ended each way, with the first few names of every way but `read`."""

    files: int = 0  # every file under the dataset path = read + empty + bad + duplicate + ignored
    read: int = 0
    empty: int = 0
    bad: int = 0
    duplicate: int = 0
    filtered: int = 0  # every document removed by a quality filter or near-dup (sharding.filters / near_dup)
    ignored: int = 0
    examples: dict[str, list[str]] = Field(default_factory=dict)  # status -> first names (bad: file:line)

    def manifest_fields(self) -> dict:
        """The manifest's fields for these counts: files_<way> for each way it records, and file_examples."""
        ways = ("read", "empty", "bad", "duplicate", "ignored")
        return {f"files_{way}": getattr(self, way) for way in ways} | {"file_examples": self.examples}


def file_status(docs: int, duplicates: int, bad: int, removed: int = 0) -> FileStatus:
    """`removed`: documents the quality filters or near-dup removed (sharding.filters / near_dup): a file whose
    every document went that way or as an exact duplicate, and not all as exact duplicates, is `filtered`."""
    if docs > duplicates + removed:
        return "read"
    if removed:
        return "filtered"
    if docs:
        return "duplicate"
    return "bad" if bad else "empty"


def account_files(job, scans, placement) -> tuple[list[SourceFile], FileCounts]:
    """Per-file entries for the manifest and the totals, from the scans' per-file counts and dedup's drops."""
    per_file = {}
    for s in sorted(scans, key=lambda s: s.index):  # a big file scanned in byte ranges has one entry per range
        for f in s.files:
            per_file[f.source] = per_file[f.source].plus(f) if f.source in per_file else f
    dups, removed = dict(placement.file_duplicates), dict(placement.file_removed)
    tally = dict.fromkeys(
        ("read", "empty", "bad", "duplicate", "filtered"), 0
    )  # plain counters: a pydantic setattr per file
    examples: dict[str, list[str]] = {"ignored": job.ignored[:EXAMPLES]} if job.ignored else {}
    entries = []
    for i, src in enumerate(job.sources):
        f = per_file[i]
        status = file_status(f.docs, dups.get(i, 0), f.bad, removed.get(i, 0))
        tally[status] += 1
        shown = examples.setdefault(status, []) if status != "read" else None
        if shown is not None and len(shown) < EXAMPLES:
            fb: BadRecord | None = f.first_bad
            shown.append(f"{src.rel}:{fb.line}: {fb.reason}" if status == "bad" and fb else src.rel)
        entries.append(
            SourceFile(
                path=src.rel,
                size=src.size,
                fingerprint=src.fingerprint,
                status=status,
                documents=f.docs - dups.get(i, 0) - removed.get(i, 0),
            )
        )
    counts = FileCounts(files=len(job.sources) + len(job.ignored), ignored=len(job.ignored), examples=examples, **tally)
    return entries, counts
