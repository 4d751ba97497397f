"""Remote command lines built from argument lists: every value goes through `shlex.quote`, never a format string.

The one shell construct added is the launcher wrapper: `cd WORKDIR && exec setsid --wait sh -c '...' ARGV...`,
which starts the command as the leader of a new session so that teardown can kill the whole tree by its
process group id (SSH signal requests do not work for root logins, and without a PTY a dropped
connection leaves the remote process running).
"""

from __future__ import annotations

import re
import shlex

from nightloom.provision.base import ProvisionError

PGID_MARK = "NIGHTLOOM_PGID"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def quote_path(path: str) -> str:
    """A quoted path; a leading `~/` becomes "$HOME"/ so it still expands, the rest stays literal."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def env_argv(env: dict[str, str]) -> list[str]:
    """`env K=V ...` as argv; names are checked (a value may hold anything, it is one quoted word)."""
    for k in env:
        if not _ENV_NAME.fullmatch(k):
            raise ProvisionError(f"environment variable name {k!r} is not a valid identifier")
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def session_command(
    workdir: str, argv: list[str], env: dict[str, str] | None = None, pgid_file: str | None = None
) -> str:
    """One shell line: cd into `workdir`, start argv as a new session, print (and record) its PGID first."""
    if not argv:
        raise ProvisionError("empty command")
    # the inner script is a constant; argv reaches it as "$@", never as shell text
    inner = f'echo "{PGID_MARK} $$"; '
    if pgid_file is not None:
        inner += 'echo "$$" > "$0"; '
    inner += 'exec "$@"'
    words = ["setsid", "--wait", "sh", "-c", inner, pgid_file or "nightloom", *env_argv(env or {}), *argv]
    return f"cd {quote_path(workdir)} && exec " + shlex.join(words)


def plain_command(argv: list[str], workdir: str | None = None) -> str:
    """argv as one quoted shell line, optionally run inside `workdir`."""
    line = shlex.join(argv)
    return f"cd {quote_path(workdir)} && {line}" if workdir else line


def kill_pgids_command(pid_glob_dir: str, pattern: str, sig: str) -> str:
    """Signal every process group recorded in `pid_glob_dir/pattern*.pgid` (idempotent; no error when none)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", pattern) or sig not in ("TERM", "KILL", "0"):
        raise ProvisionError(f"bad kill request {pattern!r} {sig!r}")
    d = quote_path(pid_glob_dir)
    return (
        f'for f in {d}/{pattern}*.pgid; do [ -f "$f" ] || continue; g=$(cat "$f"); '
        f'case "$g" in ""|*[!0-9]*) continue;; esac; '
        f'kill -{sig} -- "-$g" 2>/dev/null && echo "alive $g"; done; true'
    )
