"""`nightloom` console script: pure commands call nightloom/ directly; `run` runs the Prefect flow.

Exit codes: 0 ok, 1 run or validation failed (a spec that does not validate included), 2 usage error (bad
arguments, a file or folder that does not exist, a required option missing): the rule of flows/commands/common.py.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from flows.commands.common import UsageError, check_spec_arg, usage
from flows.defaults import set_prefect_defaults

#: subcommand modules in flows/commands/, each exposing register(subparsers) and run(args) -> int
COMMANDS = ("run", "validate", "plan", "shard", "provision", "cost", "ledger", "queue", "export", "eval", "ui")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nightloom", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"flows.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"flows.commands.{name}":
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    set_prefect_defaults()  # before any command imports Prefect (flows/defaults.py)
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on usage errors
    try:
        check_spec_arg(args)  # a missing spec file: exit 2 at once, naming the path and the current folder
        return int(args.func(args) or 0)
    except UsageError as e:
        return usage(args.command, str(e))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
