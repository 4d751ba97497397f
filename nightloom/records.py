"""The base of nightloom's typed records: pydantic models that refuse an unknown field (a misspelt name is an
error where the record is built or read, never silently dropped), and their frozen kind."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """A typed record between stages, or one read back from a run folder or the ledger: unknown fields refused."""

    model_config = ConfigDict(extra="forbid")


class FrozenRecord(Record):
    """A Record that is a value: hashable, no field set after it is built."""

    model_config = ConfigDict(extra="forbid", frozen=True)
