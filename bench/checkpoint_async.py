"""Step time with a checkpoint every step, synchronous against asynchronous (train.async_checkpoint), in one run.

The same ~42M-parameter model (6 layers, hidden 768, fp32 AdamW: ~0.5 GB of state per save) trains the same steps
twice, in fresh processes: `dcp.save` blocks the step until the checkpoint is on disk; `dcp.async_save` blocks
only while the state is copied to host memory, then a thread writes it while the next steps run. Printed: the
wall time from step to step (the step and what the save after it blocks) with no checkpoint (the baseline), with
sync and with async saves, and their ratios. On this 2-core CPU box the writer thread competes with training for
the cores; on a GPU node training runs on the device while the host writes.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_async.py [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._support import launch, make_job, write_corpus  # noqa: E402
from nightloom.shape import ModelShape  # noqa: E402

SHAPE = ModelShape("bench-42m", 6, 768, 12, 4, 2048, 256, 1024)
MODES = {"none": {}, "sync": {"checkpoint_every": 1}, "async": {"checkpoint_every": 1, "async_checkpoint": True}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    step_s = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp) / "corpus", shards=2, docs_per_shard=200)
        for mode, extra in MODES.items():
            job = make_job(
                Path(tmp) / mode,
                corpus,
                model="",
                shape=SHAPE,
                steps=a.steps,
                seq_len=128,
                global_batch=4,
                timeout_s=600,
                peak_flops=50e9,
                peak_source="bench constant",
                train_extra=extra,
                micro_batch=4,
            )
            run = launch(1, job, timeout=1800)
            # wall time from one step's metrics row to the next: the step and the save (or its staging) after it
            times = [m.time for m in run.metrics]
            step_s[mode] = statistics.median(b - a for a, b in zip(times[1:], times[2:]))
    print(f"model {SHAPE.name}: {a.steps} steps of 4x128, fp32 AdamW, a checkpoint after every step")
    for mode, s in step_s.items():
        print(f"  {mode:5s} median step {s * 1e3:7.0f} ms  ({s / step_s['none']:.2f}x no checkpoint)")
    print(f"async / sync step time: {step_s['async'] / step_s['sync']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
