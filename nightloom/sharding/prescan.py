"""A quick look at a local dataset before a run starts: its bad records, found with the shard stage's own readers
and checks, so that `nightloom run` reports a data error in a second or two, before Prefect (and a temporary
server) starts, instead of half a minute later under the flow's logs.

Bounded: it stops after `max_bytes` of input or `max_s` seconds, whichever comes first, and the shard stage reads
everything as always (and finds any bad record after that point). It reads nothing on S3, nothing when
`sharding.on_error` is skip (bad records are then dropped and counted, not errors) and nothing while the sample
corpus is still to be built. Records are checked as the shard stage checks them: sources.py's readers (JSON,
UTF-8, the text, key and kept fields) and, for chats, scan_chats.py's reader and `nightloom.chat.to_messages`
(messages, roles, contents, an assistant turn); what only the chat template can refuse is left to the shard stage.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nightloom import storage
from nightloom.sharding.errors import ON_ERROR_FIX, BadInputError
from nightloom.sharding.job import extra_columns
from nightloom.sharding.sources import COMPRESSED, SourceRef, list_inputs, read_records
from nightloom.spec import DatasetSpec, RunSpec, ShardingSpec

MAX_BYTES = 64 * 1024 * 1024  # input read at most …
MAX_S = 3.0  # … or seconds spent, whichever first
PAIRS = "pairs"  # the chat style that stands for train.task dpo's preference pairs (nightloom/chat_pairs.py)
SHOWN = 20  # bad records listed one a line; the rest are counted
CHECK_EVERY = 256  # records between looks at the clock


@dataclass
class PreScan:
    """What the pre-scan read and what it found: bad records as `FILE:LINE: reason` (the first SHOWN) and files
    that cannot be read at all (a missing path, a corrupt stream), each one line."""

    records: int = 0
    bad_records: int = 0
    lines: list[str] = field(default_factory=list)
    unreadable: int = 0
    bytes_planned: int = 0  # the bytes of the files it read whole, plus the part of the one it read in part
    total_bytes: int = 0
    limits: str = ""  # the bounds it ran under, for the report
    complete: bool = True
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.bad_records and not self.unreadable

    def bad(self, line: str) -> None:
        """One bad record (`FILE:LINE: reason`)."""
        self.bad_records += 1
        if len(self.lines) < SHOWN:
            self.lines.append(line)

    def cannot_read(self, message: str) -> None:
        """A file (or the dataset path) that cannot be read: always listed."""
        self.unreadable += 1
        self.lines.append(message)

    def report(self) -> str:
        """The lines to print: one per problem, then the counts and how much was read, and for bad records the
        fix and what it costs."""
        out = list(self.lines)
        if self.bad_records > SHOWN:
            out.append(f"... and {self.bad_records - SHOWN:,} more bad records")
        if self.unreadable:
            out.append(f"{_plural(self.unreadable, 'input')} cannot be read; nothing was run")
        if self.bad_records:
            read = "all of the input" if self.complete else f"of {_mib(self.total_bytes)}; it stops after {self.limits}"
            out.append(
                f"{_plural(self.bad_records, 'bad record')} in {self.records:,} records read before the run started "
                f"({read}, {self.seconds:.1f} s); sharding.on_error is fail, so nothing was run"
            )
            out.append(f"Fix the record{'s' if self.bad_records != 1 else ''}, or {ON_ERROR_FIX}")
        return "\n".join(out)


def _plural(n: int, what: str) -> str:
    return f"{n:,} {what}{'s' if n != 1 else ''}"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def prescan_needed(dataset: DatasetSpec, sharding: ShardingSpec) -> bool:
    """A local dataset that exists (or a path that should), bad records an error (`on_error: fail`)."""
    if sharding.on_error != "fail" or storage.is_s3(dataset.path):
        return False
    return not (dataset.sample and not Path(dataset.path).exists())  # the sample corpus: built on first use


def prescan(
    dataset: DatasetSpec,
    sharding: ShardingSpec,
    chat_style: str | None = None,
    max_bytes: int = MAX_BYTES,
    max_s: float = MAX_S,
) -> PreScan | None:
    """Read the local dataset's records from its first file on, within `max_bytes` and `max_s`, with the shard
    stage's checks; `chat_style` (train.task sft: dataset.style) checks them as chats. None when there is nothing
    to pre-scan (`prescan_needed`)."""
    if not prescan_needed(dataset, sharding):
        return None
    out, t0 = PreScan(limits=f"{_mib(max_bytes)} or {max_s:g} s"), time.monotonic()
    try:
        sources = list_inputs(dataset.path, dataset.format).sources
    except BadInputError as e:
        out.cannot_read(str(e))
        return out
    out.total_bytes = sum(s.size for s in sources)
    keep, deadline = extra_columns(dataset, sharding), t0 + max_s
    for src in sources:
        left = max_bytes - out.bytes_planned
        if left <= 0 or time.monotonic() > deadline:
            out.complete = False
            break
        span = (0, left) if src.size > left and _plain_jsonl(src) else None
        out.bytes_planned += src.size if span is None else left
        out.complete = out.complete and span is None
        try:
            records = _checked(src, dataset.text_field, sharding.key_field, keep, chat_style, span)
            out.complete = _tally(out, src, records, deadline) and out.complete
        except BadInputError as e:
            out.cannot_read(str(e))
    out.seconds = time.monotonic() - t0
    return out


def _plain_jsonl(src: SourceRef) -> bool:
    """An uncompressed JSONL file: one that can be read up to a byte offset (sources.read_records' `span`)."""
    return src.format == "jsonl" and not src.uri.lower().endswith(COMPRESSED)


def _tally(out: PreScan, src: SourceRef, records: Iterator[tuple[int, str | None]], deadline: float) -> bool:
    """Count `records` into `out`; False when the clock ran out before the last one."""
    for n, (where, err) in enumerate(records, 1):
        out.records += 1
        if err is not None:
            out.bad(f"{src.uri}:{where}: {err}")
        if n % CHECK_EVERY == 0 and time.monotonic() > deadline:
            return False
    return True


def _checked(
    src: SourceRef,
    text_field: str,
    key_field: str | None,
    keep: tuple[str, ...],
    chat_style: str | None,
    span: tuple[int, int] | None,
) -> Iterator[tuple[int, str | None]]:
    """(line or row, reason or None) for every record of `src` (in `span`), by the shard stage's own checks."""
    path = Path(src.uri)
    if chat_style is None:
        for where, _, _, err, _ in read_records(path, src.format, text_field, key_field, keep, span):
            yield where, err
        return
    from nightloom.chat import ChatError, to_messages
    from nightloom.chat_pairs import to_pair
    from nightloom.sharding.scan_chats import read_chat_records

    for where, record, _, err, _ in read_chat_records(path, src.format, key_field, keep, span):
        if err is None:
            try:
                to_pair(record) if chat_style == PAIRS else to_messages(record, chat_style)
            except ChatError as e:
                err = str(e)
        yield where, err


def prescan_spec(spec: RunSpec, max_bytes: int = MAX_BYTES, max_s: float = MAX_S) -> PreScan | None:
    """`prescan` of a run spec's dataset: as chats (its dataset.style) when train.task is sft."""
    chat_style = {"sft": spec.dataset.style, "dpo": PAIRS}.get(spec.train.task)
    return prescan(spec.dataset, spec.sharding, chat_style, max_bytes, max_s)
