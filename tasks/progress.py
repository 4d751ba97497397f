"""A heartbeat for long task steps: one log line every few seconds while a step runs, so that a terminal or a
task page is never silent for long (a fresh clone's plan builds the sample corpus and trains a tokenizer)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

EVERY_S = 5.0  # seconds between two lines of a running step


@contextmanager
def heartbeat(log, what: str, every_s: float = EVERY_S) -> Iterator[None]:
    """Log `what: still running after N s` every `every_s` seconds until the block ends (nothing for a short one)."""
    done = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            log.info("%s: still running after %.0f s", what, time.monotonic() - t0)

    thread = threading.Thread(target=beat, name=f"heartbeat {what}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def human_bytes(n: int | float) -> str:
    """'1.5 MiB': a byte count for a log line."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
