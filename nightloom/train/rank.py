"""One rank's place in a run, before any model exists: the process group and device mesh (`init_distributed`,
the layout validated first), the device's peak FLOP/s, the compute dtype, peak-memory readings and the pid file.
Split out of trainer.py (the training loop), which imports these."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nightloom import perf
from nightloom.peak_rss import peak_rss_bytes
from nightloom.perf import resolve_precision
from nightloom.runfiles import RunFiles
from nightloom.train.job import TrainJob
from nightloom.train.parallelize import validate_plan


def precision_dtype(precision: str, device_type: str) -> torch.dtype | None:
    """None = fp32 everywhere; bf16 = bf16 compute with fp32 master weights and reductions."""
    if resolve_precision(precision, device_type) in ("bf16", "fp8"):  # fp8: float8 matmuls inside bf16
        return torch.bfloat16
    return None


def reset_peak_memory(device: torch.device) -> None:
    """CUDA: start the allocator's peak count at training's first step, so loading peaks do not mask the steps'.
    CPU: nothing; the process's RSS high-water mark is never reset (nightloom/peak_rss.py says why)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA allocator bytes since reset_peak_memory, or the CPU process's true peak RSS (what /usr/bin/time sees)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def check_pack(job: TrainJob) -> None:
    """train.pack runs sft rows under DP/FSDP2 and TP (SP too); the pipeline schedule and CP's ring attention
    take no per-row document mask, so a layout with pp or cp > 1 is refused (ValueError naming the field)."""
    t, p = job.train, job.plan
    if t.pack and t.task != "sft":
        raise ValueError(f"train.pack: packing places whole conversations in a sequence; train.task is {t.task!r}")
    if t.pack and (p.pp > 1 or p.cp > 1):
        raise ValueError(
            f"train.pack: packed sequences need pp = 1 and cp = 1, the layout {p.layout()} has pp {p.pp}, cp {p.cp} "
            "(the pipeline schedule and ring attention take no per-sequence document mask)"
        )


@dataclass
class Context:
    rank: int
    world: int
    device: torch.device
    mesh: object | None
    owns_group: bool = True  # False when the caller started the process group (several jobs in one launch)


def init_distributed(job: TrainJob) -> Context:
    """Validate the layout first, then start the process group (torchrun env, or a 1-rank group)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    validate_plan(job.model, job.plan, job.train.seq_len, job.train.global_batch, world, device_type)
    check_pack(job)
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=job.train.collective_timeout_s)
    owns = not dist.is_initialized()
    if not owns:  # the caller's group (jobs run one after another in one launch): use it, leave it running
        if dist.get_world_size() != world:
            raise RuntimeError(f"the running process group has {dist.get_world_size()} ranks, WORLD_SIZE says {world}")
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device_type == "cuda" else None)
    else:  # plain `python -m nightloom.train`: a one-rank group so the code path is the same
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    mesh = job.plan.dims().build_mesh(device_type)
    return Context(rank, world, device, mesh, owns_group=owns)


def measure_peak(job: TrainJob, ctx: Context) -> tuple[float, str]:
    """Per-device peak FLOP/s: from the job, else measured once on rank 0 and broadcast."""
    if job.peak_flops:
        return job.peak_flops, job.peak_source or "job"
    t = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    if ctx.rank == 0:
        if ctx.device.type == "cuda":
            a = torch.randn(8192, 8192, device=ctx.device, dtype=torch.bfloat16)
            torch.mm(a, a)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                torch.mm(a, a)
            torch.cuda.synchronize()
            t[0] = 5 * 2 * 8192**3 / (time.perf_counter() - t0)
        else:
            t[0] = perf.measure_cpu_matmul_peak().flops
    dist.broadcast(t, src=0)
    src = "measured: torch.mm 8192 bf16 on GPU" if ctx.device.type == "cuda" else perf.cpu_matmul_peak_source()
    return float(t[0]), src


def write_pid(job: TrainJob, rank: int) -> None:
    """`<run_dir>/pids/rank-N.pid`: lets an operator (or a test) find and signal one rank."""
    path = RunFiles(job.run_dir).rank_pid(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n", encoding="utf-8")
