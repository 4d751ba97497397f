"""A process's peak resident memory, the figure `/usr/bin/time -v` reports as "Maximum resident set size": the
kernel's RSS high-water mark since the process started, never reset.

The one CPU peak-memory measurement of both training backends: the native trainer imports it, and the XTuner
ranks (whose env has no nightloom) load this file by its path (finetune/xtuner_ext/nightloom_memory.py), so the
two report the same figure. Standard library only, on purpose.

Nothing here writes "5" to /proc/self/clear_refs: that resets the process-wide mark, and every outside
measurement with it (wait4's ru_maxrss, `/usr/bin/time`, a scheduler's accounting), which then under-reports
the peak of loading and set-up.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """This process's peak RSS in bytes since it started (getrusage ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024
