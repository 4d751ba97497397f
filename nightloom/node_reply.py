"""The one line a program run on a node prints for the orchestrator: `MARK {json}`, the last such line in its
output; `ok` says whether the program did its work, `error` why not. Stdlib only: node-side programs print it.

Node programs: nightloom.finetune.node_env (the XTuner env), nightloom.finetune.base_model (a model in the node's
cache), nightloom.provision.allreduce (the bandwidth test), and nightloom/provision/node_agent.py, which is sent as
source and so writes the same line by hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ERROR_CHARS = 2000  # an error's tail kept in the reply (a pip or compiler error can run to megabytes)


@dataclass(frozen=True)
class Readied:
    """What one call readied from this machine's content-keyed cache (an env, a model): its key, whether the call
    built it (cold) or found it (warm), and the seconds the call took."""

    key: str
    created: bool
    seconds: float

    def reply_fields(self) -> dict:
        return {"key": self.key, "created": self.created, "seconds": round(self.seconds, 3)}


def reply(mark: str, fields: dict) -> None:
    """Print the program's success line: `MARK {"ok": true, ...fields}`."""
    print(mark + json.dumps({"ok": True, **fields}), flush=True)


def reply_error(mark: str, err: BaseException) -> int:
    """Print the program's failure line naming the exception (its tail); the exit status 1."""
    print(mark + json.dumps({"ok": False, "error": f"{type(err).__name__}: {err}"[-ERROR_CHARS:]}), flush=True)
    return 1


def read_reply(mark: str, output: str) -> dict | None:
    """The JSON after the last `mark` in `output`, or None when there is none. The mark may stand mid-line:
    stdout and stderr arrive merged, and a log line without its newline may precede it. A mark followed by no JSON
    is not a reply: a traceback quoting the line that prints it (Python 3.13 shows `python -c` source)."""
    for line in reversed(output.splitlines()):
        i = line.find(mark)
        if i >= 0:
            try:
                return json.loads(line[i + len(mark) :])
            except json.JSONDecodeError:
                continue
    return None


def output_tail(output: str, lines: int = 4) -> str:
    """The last lines of a node's output on one line (what a missing reply is reported with)."""
    return " | ".join(output.strip().splitlines()[-lines:]) or "no output"
