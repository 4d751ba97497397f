"""Typed sharding errors: each message names what is wrong and where (file, line or row, field)."""

from __future__ import annotations


class ShardingError(RuntimeError):
    """Base class: sharding could not produce a complete, balanced dataset."""


class BadInputError(ShardingError):
    """An input file or record is unusable (corrupt JSON/Parquet, non-UTF-8, missing field); names file:line."""


class TooSmallError(ShardingError):
    """The corpus cannot be balanced within the tolerance; the message says how much data would be needed."""


class StorageError(ShardingError):
    """An object store or folder cannot be reached or used (endpoint, bucket, credentials); never shows secrets."""
