"""Typed sharding errors: each message names what is wrong and where (file, line or row, field). An object store
that cannot be reached raises nightloom.storage.StorageError, which the sharding flow and CLI report alike."""

from __future__ import annotations


class ShardingError(RuntimeError):
    """Base class: sharding could not produce a complete, balanced dataset."""


class BadInputError(ShardingError):
    """An input file or record is unusable (corrupt JSON/Parquet, non-UTF-8, missing field); names file:line."""


class TooSmallError(ShardingError):
    """The corpus cannot be balanced within the tolerance; the message says how much data would be needed."""


#: the way past bad records, and what it costs: said with every bad-record error (shard stage and pre-scan alike)
ON_ERROR_FIX = (
    "set `sharding.on_error: skip` to drop bad records and count them in the shard report (the run then trains "
    "without them, and fails only when more than sharding.max_bad_fraction of the records are bad)"
)


def bad_record_error(uri: str, where: int, reason: str) -> BadInputError:
    """The error for one bad record under `sharding.on_error: fail`, on one line: `FILE:LINE: reason`, then the
    fix (`ON_ERROR_FIX`)."""
    return BadInputError(f"{uri}:{where}: {reason}; fix the record, or {ON_ERROR_FIX}")
