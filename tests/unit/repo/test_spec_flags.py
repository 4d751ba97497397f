"""Flags declared by the spec field they set (flows/commands/spec_flags.py): type, choices and default come from
the field, and a given flag is written over the spec's value."""

from __future__ import annotations

import argparse
import typing

import pytest

from flows.commands import shard
from flows.commands.spec_flags import SpecFlag, add_spec_flags, layer
from nightloom.spec import DatasetSpec, ShardingSpec


def _parser(flags):
    p = argparse.ArgumentParser()
    add_spec_flags(p, flags)
    return p


def test_choices_type_and_default_come_from_the_field():
    flags = (SpecFlag("--balance-by", "sharding", "balance_by", ShardingSpec),)
    flags += (SpecFlag("--tolerance", "sharding", "tolerance", ShardingSpec),)
    p = _parser(flags)
    assert p.parse_args(["--balance-by", "rows", "--tolerance", "0.5"]).tolerance == 0.5
    with pytest.raises(SystemExit):
        p.parse_args(["--balance-by", "pages"])  # not one of the Literal's values
    with pytest.raises(SystemExit):
        p.parse_args(["--tolerance", "tight"])  # the field is a float
    text = p.format_help()
    assert "(default: tokens)" in text and "[sharding.balance_by]" in text


def test_every_shard_flag_accepts_exactly_its_fields_values():
    """For each Literal field behind a `nightloom shard` flag, argparse's choices are the spec's values."""
    actions = {a.option_strings[0]: a for a in _parser(shard._FLAGS)._actions if a.option_strings}
    for f in shard._FLAGS:
        kind = f.model.model_fields[f.field].annotation
        if typing.get_origin(kind) is typing.Literal:
            assert actions[f.flag].choices == list(typing.get_args(kind)), f.flag


def test_given_flags_are_layered_over_the_spec_and_absent_ones_leave_it():
    flags = (
        SpecFlag("--input", "dataset", "path", DatasetSpec, "input"),
        SpecFlag("--shards", "sharding", "num_shards", ShardingSpec, "shards"),
        SpecFlag("--salt", "sharding", "salt", ShardingSpec),
    )
    args = _parser(flags).parse_args(["--shards", "3"])
    data = layer(args, flags, {"dataset": {"path": "a.jsonl"}, "sharding": {"num_shards": 8, "salt": "s"}})
    assert data == {"dataset": {"path": "a.jsonl"}, "sharding": {"num_shards": 3, "salt": "s"}}


def test_a_no_flag_turns_off_a_field_on_by_default_and_absent_leaves_it():
    flags = (SpecFlag("--no-dedup", "sharding", "dedup", ShardingSpec, "keep exact duplicates"),)
    p = _parser(flags)
    assert layer(p.parse_args(["--no-dedup"]), flags, {})["sharding"] == {"dedup": False}
    assert layer(p.parse_args([]), flags, {}) == {}


def test_a_field_with_a_default_factory_shows_no_placeholder_for_its_default():
    from pydantic import BaseModel, Field

    class Section(BaseModel):
        names: str = Field(default_factory=lambda: "x", description="Some names.")

    text = _parser((SpecFlag("--names", "s", "names", Section),)).format_help()
    assert "Some names [s.names]" in " ".join(text.split()) and "Undefined" not in text


def test_shard_no_dedup_reaches_the_spec(tmp_path):
    from flows.cli import build_parser

    args = build_parser().parse_args(
        ["shard", "--input", "a.jsonl", "--output", str(tmp_path), "--shards", "2", "--no-dedup"]
    )
    _, sharding, _ = shard._sections(args)
    assert sharding.dedup is False and sharding.num_shards == 2
