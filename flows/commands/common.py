"""What every `nightloom` command shares: one exit-code rule, and the checks of paths given on the command line.

Exit codes: 0 ok; 1 the run, check or validation failed (a spec that does not validate, a failed gate, a refused
job, a plan over budget); 2 a usage error: a bad argument, a file or folder that does not exist, a required option
missing (argparse's own errors exit 2 too). A command raises UsageError (flows/cli.py prints it as
`nightloom COMMAND: error: ...` and exits 2) or returns `usage(...)` / `failed(...)`.
Light on purpose: it is imported before any command's heavy imports (torch, Prefect), so a wrong path fails at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(ValueError):
    """A usage error: a bad argument, a missing file or folder, a missing option. Exit 2; the message says which."""


def usage(command: str, message: str) -> int:
    """Print a usage error the way argparse does (`nightloom COMMAND: error: ...`); EXIT_USAGE."""
    print(f"nightloom {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def failed(command: str, message: str) -> int:
    """Print why the command's work failed or was refused; EXIT_FAILED."""
    print(f"nightloom {command}: {message}", file=sys.stderr)
    return EXIT_FAILED


def spec_invalid(err: Exception) -> int:
    """A spec that does not validate (a SpecError: one `FILE:LINE: field: reason` per line): EXIT_FAILED, as
    `nightloom validate` exits for it."""
    print(str(err), file=sys.stderr)
    return EXIT_FAILED


def _not_there(path: str | Path, what: str, kind: str) -> str:
    p = Path(path)
    return f"{what} {str(path)!r} does not exist: no {kind} {p.absolute()} (current folder {Path.cwd()})"


def require_file(path: str | Path, what: str = "file") -> Path:
    """`path` as a Path if it is a file; else UsageError naming the path looked for and the current folder."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{what} {str(path)!r} is a folder, not a file ({p.absolute()})")
    if not p.is_file():
        raise UsageError(_not_there(path, what, "file"))
    return p


def require_dir(path: str | Path, what: str = "folder") -> Path:
    """`path` as a Path if it is a folder; else UsageError naming the path looked for and the current folder."""
    p = Path(path)
    if p.is_file():
        raise UsageError(f"{what} {str(path)!r} is a file, not a folder ({p.absolute()})")
    if not p.is_dir():
        raise UsageError(_not_there(path, what, "folder"))
    return p


def require_run_dir(path: str | Path) -> Path:
    """A run folder: it exists and holds a job file (job-attempt*.json, or job.json from tests and notebooks)."""
    p = require_dir(path, "run folder")
    if not any(p.glob("job*.json")):
        raise UsageError(
            f"{path}: no job*.json: not a nightloom run folder (a run's folder is `run dir:` in its summary, "
            f"under storage.root, e.g. .nightloom/runs/<run id>)"
        )
    return p


def load_spec_file(path: str | Path):
    """The RunSpec of the spec file `path`: UsageError when there is no such file (exit 2), SpecError listing every
    problem when it does not validate (exit 1)."""
    from nightloom.spec.load import load_spec

    return load_spec(require_file(path, "spec file"))


def check_spec_arg(args) -> None:
    """The command's spec path (positional SPEC or --spec), when given, names a file: checked before anything
    starts, for every command alike. UsageError otherwise."""
    spec = getattr(args, "spec", None)
    if isinstance(spec, str):
        require_file(spec, "spec file")
