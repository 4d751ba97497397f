"""Cross-node all-reduce test, run under torchrun on every node (`python -m nightloom.provision.allreduce`).

Rank 0 prints one line `NIGHTLOOM_ALLREDUCE {json}` with algbw (bytes/time) and busbw = algbw·2(n−1)/n
(nccl-tests' definition, see nightloom/provision/preflight.py). gloo on CPU, nccl with CUDA.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-mib", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--hold-s", type=float, default=0.0, help="sleep after the test (tests of cancellation)")
    ap.add_argument("--tag", default="", help="free text echoed back (tests: carried literally)")
    a = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    from nightloom.node_reply import reply
    from nightloom.provision.preflight import ALLREDUCE_MARK, busbw_allreduce

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=a.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    print(
        f"rank {rank}/{world} on {socket.gethostname()} node={os.environ.get('SLURMD_NODENAME', '-')} tag={a.tag}",
        flush=True,
    )
    n = max(1, int(a.size_mib * 2**20 // 4))
    x = torch.ones(n, dtype=torch.float32, device="cuda" if cuda else "cpu")
    for _ in range(2):  # warm-up
        dist.all_reduce(x)
    x.fill_(1.0)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        dist.all_reduce(x)
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / a.iters
    ok = bool(torch.allclose(x[:8].float().cpu(), torch.full((8,), float(world) ** a.iters)))
    nbytes = n * 4
    algbw = nbytes / dt
    if rank == 0:
        busbw = busbw_allreduce(algbw, world)
        fields = {"world": world, "bytes": nbytes, "seconds": dt, "algbw": algbw, "busbw": busbw, "correct": ok}
        reply(ALLREDUCE_MARK, fields | {"backend": dist.get_backend()})
    if a.hold_s:
        time.sleep(a.hold_s)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 3


if __name__ == "__main__":
    raise SystemExit(main())
