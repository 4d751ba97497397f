"""Run under torchrun: build the trainer's model parts for a job's layout and write, per rank, how many elements of
each parameter that rank holds (`<run_dir>/local_params.json`): what tests check to see a layout really splits."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def local_numels(parts) -> dict[str, int]:
    """Elements of each parameter on this rank: a DTensor's local shard, else the whole tensor."""
    from torch.distributed.tensor import DTensor

    out: dict[str, int] = {}
    for m in parts:
        for name, p in m.named_parameters():
            out[name] = (p.to_local() if isinstance(p, DTensor) else p).numel()
    return out


def main() -> None:
    from nightloom.train.job import TrainJob
    from nightloom.train.parallelize import build_parts

    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    job = TrainJob.model_validate_json(Path(ap.parse_args().job).read_text())
    dist.init_process_group("gloo")
    try:
        dims = job.plan.dims()
        mesh = dims.build_mesh("cpu")
        parts = build_parts(
            job.model, job.plan, dims, mesh, job.train.seq_len, job.train.seed, torch.device("cpu"), None
        )
        rows: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(rows, local_numels(parts.parts))
        if dist.get_rank() == 0:
            Path(job.run_dir, "local_params.json").write_text(json.dumps(rows, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # as the trainer does: the interpreter's native teardown of gloo/DDP threads aborted a rank now and then
    # ("terminate called without an active exception", exit -6) on a loaded CI box after all its work was done
    os._exit(0)
