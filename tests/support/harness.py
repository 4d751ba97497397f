"""Helpers for trainer tests: a tiny Parquet corpus + manifest, TrainJob files, real torchrun launches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: steps of the distributed tests' runs, and the single-process reference layout they are compared with:
#: 1 process, global batch 8 = micro_batch 2 x grad_accum 4
STEPS = 5
REF_PLAN = {"micro_batch": 2, "grad_accum": 4}


def write_corpus(folder: Path, shards: int = 4, docs_per_shard: int = 60, seed: int = 0) -> Path:
    """Parquet shards (column `text`) and a manifest.json built with the ShardManifest model (the benchmarks' own
    corpus, salted for tests)."""
    from bench._support import write_corpus as write

    return write(folder, shards, docs_per_shard, seed, salt="test")


def make_job(
    run_dir: Path,
    manifest: Path,
    *,
    model: str = "tiny",
    hf: Path | None = None,
    steps: int = 5,
    seq_len: int = 32,
    global_batch: int = 8,
    timeout_s: int = 60,
    job_kw: dict | None = None,
    train_kw: dict | None = None,
    **plan,
) -> Path:
    """Write `<run_dir>/job.json` for a TrainJob; `plan` holds ParallelPlan fields. With `hf` (a Hugging Face
    folder) the model is that folder's shape and the job loads its weights, instead of the catalog `model`."""
    from nightloom.catalog import get_model
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    run_dir.mkdir(parents=True, exist_ok=True)
    train = TrainSpec(
        **{
            "steps": steps,
            "seq_len": seq_len,
            "global_batch": global_batch,
            "lr": 3e-3,
            "warmup_steps": 2,
            "collective_timeout_s": timeout_s,
            "seed": 1234,
            **(train_kw or {}),  # may override the defaults above (lr, ...)
        }
    )
    if hf is not None:
        from nightloom.hf.config import shape_from_hf_config

        job_kw = {"weights": str(hf), "hf_config": str(hf / "config.json"), **(job_kw or {})}
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=shape_from_hf_config(hf) if hf is not None else get_model(model),
        plan=ParallelPlan(**plan),
        train=train,
        manifest=str(manifest),
        **{"peak_flops": 50e9, "peak_source": "test constant", **(job_kw or {})},
    )
    p = run_dir / "job.json"
    p.write_text(job.model_dump_json(indent=2), encoding="utf-8")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    e.pop("CUDA_VISIBLE_DEVICES", None)
    return e


def torchrun_prefix(nproc: int) -> list[str]:
    """`python -m torch.distributed.run --standalone` for nproc processes on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--monitor-interval=0.2",
    ]


def torchrun_cmd(nproc: int, job: Path) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "nightloom.train", "--job", str(job)]
    return [*torchrun_prefix(nproc), "-m", "nightloom.train", "--job", str(job)]


@dataclass
class RunOut:
    rc: int
    output: str
    losses: list[float]
    metrics: list


def launch(nproc: int, job: Path, timeout: float = 180, check: bool = True) -> RunOut:
    """Run the trainer for real (torchrun for nproc > 1) and read back its metrics."""
    from nightloom.metrics import read_metrics

    p = subprocess.run(
        torchrun_cmd(nproc, job), cwd=ROOT, env=env(), capture_output=True, text=True, check=False, timeout=timeout
    )
    out = p.stdout + p.stderr
    if check and p.returncode != 0:
        raise AssertionError(f"trainer exited {p.returncode}:\n{out[-6000:]}")
    mpath = job.parent / "metrics.jsonl"
    metrics = read_metrics(mpath) if mpath.exists() else []
    return RunOut(p.returncode, out, [m.loss for m in metrics], metrics)


def launch_many(nproc: int, jobs: list[Path], timeout: float = 600) -> dict[Path, RunOut]:
    """Run several jobs one after another in ONE torchrun launch (tests/distributed/multi_job_worker.py): each
    job's metrics come from its own run folder; the shared output goes with every job. A job after a failed one
    does not run (its RunOut has no metrics)."""
    from nightloom.metrics import read_metrics

    cmd = [*torchrun_prefix(nproc), str(ROOT / "tests" / "distributed" / "multi_job_worker.py"), *map(str, jobs)]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, check=False, timeout=timeout)
    out = p.stdout + p.stderr
    runs = {}
    for job in jobs:
        mpath = job.parent / "metrics.jsonl"
        metrics = read_metrics(mpath) if mpath.exists() else []
        runs[job] = RunOut(p.returncode, out, [m.loss for m in metrics], metrics)
    return runs


def launch_groups(*groups: tuple[int, dict[str, Path], float]) -> list[dict[str, tuple[Path, RunOut]]]:
    """Each group (process count, named job files, timeout) in its own launch_many, one group after another; for
    each group, name -> (job file, its run). The layout parity tests launch their one-process references this way,
    then every layout of one process count together."""
    out = []
    for nproc, jobs, timeout in groups:
        runs = launch_many(nproc, list(jobs.values()), timeout=timeout)
        out.append({name: (job, runs[job]) for name, job in jobs.items()})
    return out


def result(job: Path) -> dict:
    return json.loads((job.parent / "result.json").read_text())
