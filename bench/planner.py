"""Planner speed: Llama-3-405B on 16,384 H100 (2,048 nodes × 8), seq 8192, global batch 2048 (16M tokens).

Prints the wall time, layouts considered and pruned, and the choice. Target: under 2 s on this machine."""

from __future__ import annotations

import time

from nightloom.planner import plan


def main() -> None:
    t0 = time.perf_counter()
    r = plan("llama3-405b", "h100-80gb", nodes=2048, gpus_per_node=8, seq_len=8192, global_batch=2048)
    dt = time.perf_counter() - t0
    c = r.chosen
    print(f"plan llama3-405b on 16,384 × h100-80gb: {dt:.3f} s (target < 2 s: {dt / 2.0:.2f} of budget)")
    print(
        f"layouts considered {r.considered}, pruned {r.pruned} ({r.pruned / r.considered:.0%}), "
        f"families rejected {len(r.rejected)}"
    )
    print(
        f"chosen {c.layout()} mb={c.micro_batch} accum={c.grad_accum} v={c.virtual_stages} recompute={c.recompute}: "
        f"{c.memory_gib_per_gpu:.1f} GiB/GPU, MFU {c.mfu:.3f}, HFU {c.hfu:.3f}, {c.tokens_per_s / 1e6:.2f} M tokens/s"
    )
    t0 = time.perf_counter()
    r2 = plan("llama2-70b", "a800-80gb", nodes=8, gpus_per_node=4, seq_len=4096, global_batch=32)
    print(
        f"plan llama2-70b on 32 × a800-80gb: {time.perf_counter() - t0:.3f} s, considered {r2.considered}, "
        f"pruned {r2.pruned}, chosen {r2.chosen.layout()}"
    )


if __name__ == "__main__":
    main()
