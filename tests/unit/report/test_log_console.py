"""Prefect's console log lines print messages verbatim (flows/console.py): `corpus.jsonl:100:` is no emoji, and a
data error's message is printed without the stack that Prefect logs with it."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest

from tests.support.harness import ROOT


@pytest.mark.slow
def test_a_message_with_emoji_codes_reaches_the_terminal_verbatim():
    """Through Prefect's own logging setup (logging.yml, its console handler), as a flow's log line would go."""
    message = "corpus.jsonl:100: bad record :1234: [bold]x[/bold]"
    code = (
        "from flows.defaults import set_prefect_defaults\n"
        "set_prefect_defaults()\n"
        "import prefect.main\n"
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


def test_importing_flows_sets_nothing_and_each_entry_point_sets_the_defaults(tmp_path):
    """flows/ has no import-time side effect; the CLI, the notebook entry and `nightloom ui`'s processes apply
    flows/defaults.py, a user's own values kept."""
    from flows.commands.ui import prefect_env
    from flows.defaults import PREFECT_DEFAULTS, set_prefect_defaults

    code = (
        "import json, os\nbefore = dict(os.environ)\nimport flows, flows.cli, flows.defaults, flows.commands.ui\n"
        "print(json.dumps(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in PREFECT_DEFAULTS}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])
    mine = {"OMP_NUM_THREADS": "4", "PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS": "my.Handler"}
    assert set_prefect_defaults(dict(mine)) == PREFECT_DEFAULTS | mine
    ui = prefect_env("http://127.0.0.1:1/api", tmp_path)
    assert ui["PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS"] == os.environ.get(
        "PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS", PREFECT_DEFAULTS["PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS"]
    )
    assert ui["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
