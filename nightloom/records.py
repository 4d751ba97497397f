"""The base of nightloom's typed records: pydantic models that refuse an unknown field (a misspelt name is an
error where the record is built or read, never silently dropped), and their frozen kind."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """A typed record between stages, or one read back from a run folder or the ledger: unknown fields refused."""

    model_config = ConfigDict(extra="forbid")


class FrozenRecord(Record):
    """A Record that is a value: hashable, no field set after it is built."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def field_type(model: type[BaseModel], name: str) -> tuple[Any, bool]:
    """A model field's type without `| None` (a union of several others stays whole), and whether it may be None:
    what a table column or a command-line flag derived from the field is typed by."""
    annotation = model.model_fields[name].annotation
    args = get_args(annotation)
    others = [a for a in args if a is not type(None)]
    optional = type(None) in args
    return (others[0] if optional and len(others) == 1 else annotation), optional
