"""Subcommands of the `nightloom` CLI, one module each: register(subparsers) and run(args) -> int."""
