"""Trainer overhead and CPU throughput, measured in one run (ratios, not absolute claims).

1. Single process: median step time of `python -m nightloom.train` against a plain PyTorch loop (same model
   class, init, data windows, AdamW, clipping) on the same machine, interleaved; target ratio <= 1.10.
2. tokens/s and CPU MFU (PaLM App. B via nightloom.perf, against a matmul peak measured here) for 1, 2 and
   4 processes (FSDP data parallel, micro-batch 8 per rank).

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/trainer.py [--steps 30] [--model tiny] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from bench._support import launch, make_job, write_corpus
from nightloom import perf
from nightloom.catalog import get_model
from nightloom.train.data import PackedWindows, StepLoader
from nightloom.train.model import build_model
from nightloom.train.parallelize import loss_fn
from nightloom.train.trainer import lr_at

WARMUP = 3


def plain_loop(model_name: str, manifest: Path, steps: int, seq_len: int, mb: int) -> list[float]:
    """The baseline: a textbook loop, no process group, no metrics, no checkpoint."""
    torch.manual_seed(1234)
    shape = get_model(model_name)
    model = build_model(shape, seq_len, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(1234)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95), foreach=True)
    loader = StepLoader(PackedWindows(str(manifest), seq_len), mb, 1, 1, 0)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, 3e-3, 2, steps, 0.1)
        ((x, y),) = loader.batch(step).micro
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times[WARMUP:]


def trainer_run(
    nproc: int, model: str, manifest: Path, steps: int, seq_len: int, mb: int, peak: float, tmp: Path, tag: str
):
    job = make_job(
        tmp / tag,
        manifest,
        model=model,
        steps=steps,
        seq_len=seq_len,
        global_batch=mb * nproc,
        timeout_s=120,
        peak_flops=peak,
        peak_source="bench: measured",
        micro_batch=mb,
        grad_accum=1,
        dp_shard=nproc,
    )
    return launch(nproc, job, timeout=900).metrics[WARMUP:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="nightloom-bench-"))
    manifest = write_corpus(tmp / "corpus", shards=4, docs_per_shard=400)
    peak = perf.measure_cpu_matmul_peak()
    shape = get_model(a.model)
    print(
        f"model {a.model} ({perf.count_params(shape):,} params), seq {a.seq_len}, micro-batch {a.micro_batch}, "
        f"{a.steps} steps ({WARMUP} warm-up dropped); peak {peak.flops / 1e9:.1f} GFLOP/s ({peak.source})"
    )

    plain, ours = [], []
    for r in range(a.repeats):  # interleave to share the (noisy, shared) host's good and bad moments
        plain += plain_loop(a.model, manifest, a.steps, a.seq_len, a.micro_batch)
        ours += [
            m.step_time_s
            for m in trainer_run(
                1, a.model, manifest, a.steps, a.seq_len, a.micro_batch, peak.flops, tmp, f"single-{r}"
            )
        ]
    p, o = statistics.median(plain), statistics.median(ours)
    print(
        f"\n1 process, median step: plain loop {p * 1e3:.1f} ms, nightloom.train {o * 1e3:.1f} ms "
        f"-> ratio {o / p:.3f} (target <= 1.10)"
    )

    fpt = perf.flops_per_token(shape, a.seq_len)
    print(f"\n{'procs':>5} {'tokens/s':>10} {'MFU':>7} {'speed-up':>9} {'step ms':>8}")
    base = None
    for n in (1, 2, 4):
        ms = trainer_run(n, a.model, manifest, a.steps, a.seq_len, a.micro_batch, peak.flops, tmp, f"dp{n}")
        tps = statistics.median(m.tokens_per_s for m in ms)
        mfu = perf.mfu(tps, fpt, n, peak.flops)
        base = base or tps
        print(
            f"{n:>5} {tps:>10,.0f} {mfu:>7.1%} {tps / base:>8.2f}x "
            f"{statistics.median(m.step_time_s for m in ms) * 1e3:>8.1f}",
            flush=True,
        )
    print(f"\n(host has {os.cpu_count()} cores; processes beyond that share them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
