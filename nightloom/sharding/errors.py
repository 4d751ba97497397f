"""Typed sharding errors: each message names what is wrong and where (file, line or row, field). An object store
that cannot be reached raises nightloom.storage.StorageError, which the sharding flow and CLI report alike."""

from __future__ import annotations


class ShardingError(RuntimeError):
    """Base class: sharding could not produce a complete, balanced dataset."""


class BadInputError(ShardingError):
    """An input file or record is unusable (corrupt JSON/Parquet, non-UTF-8, missing field); names file:line."""


class TooSmallError(ShardingError):
    """The corpus cannot be balanced within the tolerance; the message says how much data would be needed."""
