"""Expert-parallel dispatch on CPU, and the planner's all-to-all share for Qwen3-30B-A3B on 8 × H100.

1. Measured: one MoE layer (nightloom/train/moe.py's MoEFeedForward, a Qwen3-MoE-shaped layer shrunk to CPU size)
   forward + backward, EP2 on 2 gloo processes (torchrun; each rank holds half the experts and sends rows by
   all_to_all) against the dense-equivalent loop (the same layer in one process with every expert local), on the
   same tokens per step in all: tokens/s of each and EP2 / loop, one thread per process.
2. Predicted: the planner's plan for Qwen3-30B-A3B on 8 × H100 (EP drawn from FSDP, as the trainer runs it), its
   step time and the exposed all-to-all time (planner.steptime.all_to_all_s per dispatch/combine, 4 per MoE layer),
   the share printed with the formula's source (docs/architecture.md, Formulas: mixture of experts).

    PYTHONPATH=. python bench/moe_dispatch.py [--tokens 4096] [--steps 10] [--experts 16] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMULA_SOURCE = (
    "docs/architecture.md, Formulas, mixture of experts: per MoE layer 4 all-to-alls (dispatch, combine, forward "
    "and backward) of s·b/t·k·h·2 bytes, (local−1)/ep over NVLink and (ep−local)/ep over the NIC, the slower, not "
    "overlapped (Megatron-Core's default dispatcher); bus bandwidth as nccl-tests' alltoall, algbw·(n−1)/n"
)


def _layer(args, ep: int, rank: int):
    """The MoE layer with every rank's same initial weights; under EP only this rank's E/ep experts."""
    import torch

    from nightloom.catalog import MODELS
    from nightloom.train.moe import GroupedExperts, MoEFeedForward

    shape = replace(
        MODELS["qwen3-30b-a3b"],
        hidden=args.hidden,
        num_experts=args.experts,
        experts_per_token=args.top_k,
        expert_ffn_hidden=args.expert_ffn,
    )
    torch.manual_seed(0)
    ffn = MoEFeedForward(shape)
    for w in (ffn.experts.w1, ffn.experts.w3, ffn.experts.w2):
        torch.nn.init.normal_(w, std=0.02)
    if ep > 1:
        local = args.experts // ep
        mine = GroupedExperts(local, args.hidden, args.expert_ffn)
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(mine, name).copy_(getattr(ffn.experts, name)[rank * local : (rank + 1) * local])
        ffn.experts = mine
    return ffn


def _time(ffn, tokens: int, hidden: int, steps: int, seed: int, barrier=None) -> float:
    """Seconds for `steps` forward + backward passes of `tokens` rows (after 2 warm-up steps)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, hidden, generator=g)
    for i in range(steps + 2):
        if i == 2:
            if barrier:
                barrier()
            start = time.perf_counter()
        x.requires_grad_(True)
        ffn(x).square().mean().backward()
        x = x.detach()
    if barrier:
        barrier()
    return time.perf_counter() - start


def worker(args) -> None:
    """One EP2 rank (under torchrun): its own tokens/2 rows per step; rank 0 writes the timing."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    ffn = _layer(args, ep, rank)
    ffn.ep_group, ffn.ep_size = dist.group.WORLD, ep
    secs = _time(ffn, args.tokens // ep, args.hidden, args.steps, seed=rank + 1, barrier=dist.barrier)
    t = torch.tensor([secs])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"seconds": float(t), "ranks": ep}))
    dist.destroy_process_group()


def measure(args) -> dict[str, float]:
    """Dense-equivalent loop here (one thread), then EP2 via torchrun; tokens/s of both over the same tokens."""
    import torch

    torch.set_num_threads(1)
    loop_s = _time(_layer(args, 1, 0), args.tokens, args.hidden, args.steps, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ep2.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        cmd += [str(Path(__file__).resolve()), "--worker", "--out", str(out)] + _pass_through(args)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"EP2 torchrun exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}")
        ep_s = json.loads(out.read_text())["seconds"]
    done = args.tokens * args.steps
    return {"loop_tok_s": done / loop_s, "ep2_tok_s": done / ep_s, "loop_s": loop_s, "ep2_s": ep_s}


def _pass_through(args) -> list[str]:
    keys = ("tokens", "steps", "experts", "top_k", "hidden", "expert_ffn")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def predicted(seq: int, global_batch: int, ep: int | None = None) -> dict[str, object]:
    """The planner's choice for Qwen3-30B-A3B on one 8 × H100 node (EP its choice, or pinned to `ep`) and the
    all-to-all share of its step."""
    from dataclasses import replace as with_

    from nightloom.catalog import MODELS, get_gpu
    from nightloom.planner import plan, trainer_pins
    from nightloom.planner.steptime import DEFAULT_EFFICIENCY, all_to_all_s, step_time

    shape, gpu = MODELS["qwen3-30b-a3b"], get_gpu("h100-80gb")
    report = plan(shape, "h100-80gb", 1, 8, seq, global_batch, layout=with_(trainer_pins(shape, None), ep=ep))
    c = report.chosen.dims()
    st = step_time(shape, c, seq, gpu, 8, report.efficiency or DEFAULT_EFFICIENCY)
    payload = seq * c.micro_batch / c.cp / c.tp * shape.experts_per_token * shape.hidden * 2
    return {
        "layout": f"{report.chosen.layout()} mb={c.micro_batch} accum={c.grad_accum} recompute={c.recompute}",
        "fits": report.chosen.fits,
        "mem_gib": report.chosen.memory_gib_per_gpu,
        "step_s": st.step_s,
        "a2a_one_s": all_to_all_s(c, payload, 8, gpu),
        "a2a_bytes": payload,
        "ep_comm_s": st.ep_comm_s,
        "share": st.ep_comm_s / st.step_s,
        "mfu": report.chosen.mfu,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per step, all ranks together")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--expert-ffn", type=int, default=384)
    ap.add_argument("--seq", type=int, default=4096, help="planner: sequence length")
    ap.add_argument("--global-batch", type=int, default=64, help="planner: sequences per step")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    print(
        f"MoE layer (Qwen3-MoE math): hidden {args.hidden}, {args.experts} experts of ffn {args.expert_ffn}, "
        f"top-{args.top_k}; {args.tokens} tokens per step, {args.steps} timed forward+backward steps, fp32, "
        "1 thread per process"
    )
    m = measure(args)
    print(
        f"  dense-equivalent loop, 1 process, all experts local: {m['loop_tok_s']:,.0f} tokens/s ({m['loop_s']:.2f} s)"
    )
    print(
        f"  EP2, 2 gloo processes (torchrun), all_to_all dispatch: {m['ep2_tok_s']:,.0f} tokens/s ({m['ep2_s']:.2f} s)"
    )
    print(f"  EP2 / loop: {m['ep2_tok_s'] / m['loop_tok_s']:.2f}x (2 processes against 1; ideal 2.0x without comm)")
    print(f"planner: Qwen3-30B-A3B on 8 x H100-80GB, seq {args.seq}, global batch {args.global_batch}")
    for ep in (None, 2, 4, 8):
        p = predicted(args.seq, args.global_batch, ep)
        tag = "planner's choice" if ep is None else f"ep={ep} pinned"
        print(f"  {tag}: {p['layout']}, {p['mem_gib']:.1f} GiB/GPU, fits {p['fits']}, MFU {p['mfu']:.3f}")
        print(
            f"    one all-to-all: {p['a2a_bytes'] / 2**20:.1f} MiB per rank -> {p['a2a_one_s'] * 1e3:.3f} ms "
            f"(planner.steptime.all_to_all_s); step {p['step_s']:.3f} s, all-to-all {p['ep_comm_s']:.3f} s exposed: "
            f"{100 * p['share']:.1f}% of the step"
        )
    print(f"  formula: {FORMULA_SOURCE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
