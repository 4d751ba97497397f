"""`nightloom validate SPEC`: check a run spec and report every problem, before anything is rented."""

from __future__ import annotations

from flows.commands.common import load_spec_file, spec_invalid
from nightloom.spec import SpecError


def register(sub) -> None:
    p = sub.add_parser("validate", help="validate a run spec (all errors at once, with file:line: field.path)")
    p.add_argument("spec", help="path to the run spec YAML")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        spec = load_spec_file(args.spec)
    except SpecError as e:
        return spec_invalid(e)
    print(f"{args.spec}: ok (run {spec.name}, spec hash {spec.spec_hash()}, world size {spec.world_size})")
    return 0
