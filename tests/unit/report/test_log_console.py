"""Prefect's console log lines print messages verbatim (flows/console.py): `corpus.jsonl:100:` is no emoji, and a
data error's message is printed without the stack that Prefect logs with it."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

from tests.support.harness import ROOT


def test_a_message_with_emoji_codes_reaches_the_terminal_verbatim():
    """Through Prefect's own logging setup (logging.yml, its console handler), as a flow's log line would go."""
    message = "corpus.jsonl:100: bad record :1234: [bold]x[/bold]"
    code = (
        "import flows, prefect.main\n"
        "from prefect.logging import get_logger\n"
        f"get_logger('nightloom').warning({message!r})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"WARNING | prefect.nightloom - {message}" in r.stderr, r.stderr[-2000:]


def _line(exc: BaseException) -> str:
    """What the console handler prints for an ERROR logged with `exc` (as Prefect logs a failed task)."""
    from flows.console import VerbatimConsoleHandler

    stream = io.StringIO()
    handler = VerbatimConsoleHandler(stream=stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        raise exc
    except type(exc):
        record = logging.LogRecord(
            "prefect.task_runs", logging.ERROR, __file__, 1, "failed: %r", (exc,), sys.exc_info()
        )
    handler.handle(record)
    assert record.exc_info is not None  # the record itself is untouched: the API handler still sends the stack
    return stream.getvalue()


def test_a_data_error_is_printed_without_its_traceback():
    from nightloom.sharding.errors import BadInputError

    out = _line(BadInputError("c.jsonl:42: messages[0].role: unknown role 'wizard'"))
    assert "c.jsonl:42: messages[0].role: unknown role 'wizard'" in out and "Traceback" not in out
    assert "Traceback" in _line(ValueError("a bug"))
