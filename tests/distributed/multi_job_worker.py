"""torchrun worker: run several TrainJobs one after another in one launch, in one process group (the trainer uses a
group it finds running and leaves it). On a 2-core machine a torchrun start (4 processes importing torch) costs
more than a 5-step tiny run, so the parity table launches once per world size, not once per layout.

`python -m torch.distributed.run --nproc-per-node=N tests/distributed/multi_job_worker.py JOB.json [JOB.json ...]`
Stops at the first job that fails (its ranks may be stuck in a collective the others left)."""

from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist

from nightloom.train.__main__ import main as train_main

MARK = "[multi-job]"


def main(jobs: list[str]) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    for job in jobs:
        if rank == 0:
            print(f"{MARK} start {job}", flush=True)
        rc = train_main(["--job", job])
        if rc != 0:
            print(f"{MARK} rank {rank} failed {job} rc {rc}", flush=True)
            return rc
        if rank == 0:
            print(f"{MARK} done {job}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
