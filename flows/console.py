"""Prefect's console log handler with messages printed verbatim.

Prefect prints every log line through a Rich console, which turns `:name:` codes into emoji: a bad record at
`corpus.jsonl:1234:` or `:100:` came out as `corpus.jsonl🔢` or `💯`. Prefect's PREFECT_LOGGING_MARKUP only turns
Rich markup on and off (off by default) and its handler has no emoji setting, so the entry points name this
handler in PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS (Prefect's logging.yml override, read when Prefect is first
imported; a user's own setting wins) through flows/defaults.py's set_prefect_defaults.
Highlighting (levels, URLs, run names in colour) is Prefect's, unchanged.

A data error (a bad record, a corpus too small to balance, a chat its template refuses) is printed without its
traceback: Prefect logs a failed task's exception, then its sub-flow's and its flow's, each with the whole stack,
and the message (file:line: field: reason) is all there is to read. Other exceptions keep their tracebacks, and the
API handler (the UI's logs) keeps every traceback.
"""

from __future__ import annotations

import copy
import logging

from prefect.logging.handlers import PrefectConsoleHandler


class VerbatimConsoleHandler(PrefectConsoleHandler):
    """PrefectConsoleHandler without emoji codes: the message's characters are the ones printed."""

    def format(self, record: logging.LogRecord) -> str:
        """Prefect's format, without the traceback of a data error (`data_error`)."""
        if record.exc_info and data_error(record.exc_info[1]):
            record = copy.copy(record)  # other handlers (the API's) still see the traceback
            record.exc_info, record.exc_text = None, None
        return super().format(record)

    def emit(self, record: logging.LogRecord) -> None:
        """Prefect's emit, with Rich's emoji replacement off (markup stays PREFECT_LOGGING_MARKUP's, off by
        default)."""
        try:
            self.console.print(self.format(record), soft_wrap=True, emoji=False)
        except RecursionError:  # as logging.StreamHandler.emit (https://bugs.python.org/issue36272)
            raise
        except Exception:  # noqa: BLE001 - logging's own rule: a handler reports, never raises
            self.handleError(record)


def data_error(exc: BaseException | None) -> bool:
    """An error in the data whose message says all (nightloom's ShardingError and ChatError: file:line: field:
    reason, or what the corpus lacks), not a failure of the code, whose stack matters."""
    if exc is None:
        return False
    from nightloom.chat import ChatError
    from nightloom.sharding.errors import ShardingError

    return isinstance(exc, (ShardingError, ChatError))
