"""Command-line flags that each set one field of a run spec section (`--shards` sets sharding.num_shards).

A flag is declared once, by the field it sets: its type, its choices (a Literal field's values) and the default in
its help come from that field, so the command line never drifts from the spec. `layer` puts the given flags over
a spec's sections.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from nightloom.records import field_type


@dataclass(frozen=True)
class SpecFlag:
    """`--flag` sets `section.field` of the spec (`section`: the section's dotted path). `help`, when given,
    replaces the field's description and default (a flag whose spec default does not apply: one required without
    a spec, one whose words say "relative to the spec")."""

    flag: str
    section: str
    field: str
    model: type[BaseModel]
    help: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


def add_spec_flags(parser, flags: tuple[SpecFlag, ...]) -> None:
    """Register each flag with its field's type, choices, and description (plus the default, when there is one)."""
    for f in flags:
        info = f.model.model_fields[f.field]
        kind, _ = field_type(f.model, f.field)
        kwargs: dict = {"dest": f.dest, "default": None}
        if typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(kind))
        elif kind is bool:  # a switch: it turns on a field off by default, or off one on by default (--no-...)
            kwargs["action"] = "store_false" if info.default is True else "store_true"
        elif kind in (int, float):
            kwargs["type"] = kind
        text = f.help
        if text is None:  # the field's own words, and its default
            text = (info.description or "").rstrip(".")
            shown = info.default not in (None, PydanticUndefined) and kind is not bool  # a default_factory: not shown
            text += f" (default: {info.default})" if shown else ""
        text = f"{text} [{f.section}.{f.field}]".replace("%", "%%")  # argparse formats help with %
        parser.add_argument(f.flag, help=text, **kwargs)


def layer(args, flags: tuple[SpecFlag, ...], data: dict[str, dict]) -> dict[str, dict]:
    """`data` (section -> field values) with every flag given on the command line written over it."""
    for f in flags:
        value = getattr(args, f.dest, None)
        if value is not None:
            data.setdefault(f.section, {})[f.field] = value
    return data
