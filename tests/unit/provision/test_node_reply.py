"""The line a node-side program prints for the orchestrator (nightloom/node_reply.py), read back as the
orchestrator reads it: from merged stdout and stderr, the last one, its error's tail kept."""

from __future__ import annotations

import subprocess
import sys

from nightloom.node_reply import ERROR_CHARS, Readied, read_reply, reply, reply_error

MARK = "TEST_MARK "


def test_a_reply_printed_mid_line_after_a_log_line_is_found(capsys):
    print("pip: collecting …", end="")  # a log line whose newline has not come yet
    reply(MARK, {"path": "/c/k"})
    assert read_reply(MARK, capsys.readouterr().out) == {"ok": True, "path": "/c/k"}


def test_the_last_reply_wins_and_none_means_none_printed(capsys):
    reply(MARK, {"n": 1})
    reply(MARK, {"n": 2})
    assert read_reply(MARK, capsys.readouterr().out)["n"] == 2
    assert read_reply(MARK, "Traceback …\nModuleNotFoundError: x\n") is None


def test_an_error_reply_names_the_exception_and_keeps_its_tail(capsys):
    long = "x" * (3 * ERROR_CHARS) + " the end"
    assert reply_error(MARK, OSError(long)) == 1
    got = read_reply(MARK, capsys.readouterr().out)
    assert got["ok"] is False and len(got["error"]) == ERROR_CHARS and got["error"].endswith("the end")
    assert reply_error(MARK, ValueError("short")) == 1
    assert read_reply(MARK, capsys.readouterr().out)["error"] == "ValueError: short"


def test_a_readied_cache_entry_reports_warm_or_cold_and_its_seconds():
    assert Readied("k1", True, 1.23456).reply_fields() == {"key": "k1", "created": True, "seconds": 1.235}


def test_a_node_program_reply_crosses_a_process_with_stderr_merged():
    """The real path: a child prints to stderr and stdout; the orchestrator reads both merged."""
    code = (
        "import sys; from nightloom.node_reply import reply; "
        "sys.stderr.write('warning: slow disk'); sys.stderr.flush(); reply('TEST_MARK ', {'gpus': []})"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert read_reply(MARK, r.stderr + r.stdout) == {"ok": True, "gpus": []}


def test_a_mark_quoted_in_a_traceback_is_not_a_reply():
    """Python 3.13 prints `python -c` source lines in tracebacks: the line that prints the reply, mark and all."""
    out = (
        'NIGHTLOOM_JSON {"ok": true, "stage": "early"}\n'
        "Traceback (most recent call last):\n"
        '    print("NIGHTLOOM_JSON " + json.dumps(obj), flush=True)\n'
        "OSError: [Errno 28] No space left on device\n"
    )
    assert read_reply("NIGHTLOOM_JSON ", out) == {"ok": True, "stage": "early"}
    assert read_reply("NIGHTLOOM_JSON ", out.split("\n", 1)[1]) is None
