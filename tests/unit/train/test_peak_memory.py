"""The trainer's CPU peak memory is the process's true peak: what an outside measurement (wait4's ru_maxrss, the
figure `/usr/bin/time -v` prints) reports, set-up included. The trainer once reset the process's RSS high-water
mark at step 1 (clear_refs "5"), which hid the peak from every outside tool as well."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.harness import ROOT, env, make_job, write_corpus

MiB = 2**20
BEFORE = 768 * MiB  # touched (then freed) before training starts: above anything the tiny run itself holds

SCRIPT = f"""
import sys
block = b"\\x01" * {BEFORE}  # every page written: resident
del block
from nightloom.train.__main__ import main
sys.exit(main(["--job", sys.argv[1]]))
"""


@pytest.mark.slow
def test_reported_peak_is_the_process_peak_an_outside_measurement_sees(tmp_path):
    from nightloom.metrics import read_metrics

    job = make_job(
        tmp_path / "run", write_corpus(tmp_path / "corpus", shards=1, docs_per_shard=20), steps=2, micro_batch=8
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(job)], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)  # what /usr/bin/time -v reads
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, out[-4000:]
    outside = usage.ru_maxrss * 1024  # KiB on Linux
    reported = max(m.peak_mem_bytes for m in read_metrics(job.parent / "metrics.jsonl"))
    print(f"reported peak {reported / MiB:.0f} MiB, outside ru_maxrss {outside / MiB:.0f} MiB")
    assert reported >= BEFORE  # the set-up peak counts: nothing reset the mark at step 1
    assert outside >= reported  # the process can only have grown after the last step ...
    assert outside - reported < 0.05 * outside  # ... by little (the final checkpoint): the two agree
