"""Planner speed: Llama-3-405B on 16,384 H100 (2,048 nodes × 8), seq 8192, global batch 2048 (16M tokens).

Prints the wall time, layouts considered and pruned, and the choice. Target: under 2 s on this machine.
Then the layout Meta trained 405B with (TP8·PP16·DP128, 126 layers on uneven stages) evaluated beside the
choice, and a long-context case (Llama 3.1 405B at 128k tokens: context parallel). Each twice: attention scores
stored (the default model) and a fused attention kernel (`fused_attention=True`, what Meta's stack ran).
Last, PTD-P's 1T GPT on 3,072 A100 (pp up to 64, interleaved and zbv schedules: the deepest pipelines the search
simulates), timed with the schedules' cached op orders and again with them rebuilt for every candidate, as
before 2026-12-07: the ratio is the caches' share of the speed-up."""

from __future__ import annotations

import time

from nightloom.catalog import MODELS
from nightloom.planner import plan


def main() -> None:
    for fused in (False, True):
        print(f"\n== attention: {'fused kernel' if fused else 'scores stored (materialized)'}")
        cases(fused)
    t0 = time.perf_counter()
    r2 = plan("llama2-70b", "a800-80gb", nodes=8, gpus_per_node=4, seq_len=4096, global_batch=32)
    print(
        f"\nplan llama2-70b on 32 × a800-80gb: {time.perf_counter() - t0:.3f} s, considered {r2.considered}, "
        f"pruned {r2.pruned}, chosen {r2.chosen.layout()}"
    )
    deep_pipelines()


def cases(fused: bool) -> None:
    t0 = time.perf_counter()
    r = plan(
        "llama3-405b", "h100-80gb", nodes=2048, gpus_per_node=8, seq_len=8192, global_batch=2048, fused_attention=fused
    )
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
    meta = plan(
        "llama3-405b",
        "h100-80gb",
        nodes=2048,
        gpus_per_node=8,
        seq_len=8192,
        global_batch=2048,
        layout="tp=8,pp=16,dp=128",
        fused_attention=fused,
    ).chosen
    print(
        f"Meta's layout {meta.layout()} stages {':'.join(map(str, meta.stages or []))} v={meta.virtual_stages} "
        f"mb={meta.micro_batch} recompute={meta.recompute}: {meta.memory_gib_per_gpu:.1f} GiB/GPU, MFU {meta.mfu:.3f} "
        f"(chosen: {c.mfu:.3f})"
    )
    t0 = time.perf_counter()
    lc = plan(
        MODELS["llama3.1-405b"], "h100-80gb", nodes=2048, gpus_per_node=8, seq_len=131072, global_batch=128,
        fused_attention=fused,
    ).chosen  # fmt: skip
    print(
        f"long context llama3.1-405b seq 131072 × 128: {time.perf_counter() - t0:.3f} s, chosen {lc.layout()} "
        f"mb={lc.micro_batch} recompute={lc.recompute}: {lc.memory_gib_per_gpu:.1f} GiB/GPU, MFU {lc.mfu:.3f}"
    )


def deep_pipelines() -> None:
    from nightloom.planner import inflight

    def timed() -> tuple[float, str]:
        inflight.in_flight_layers.cache_clear()
        t0 = time.perf_counter()
        r = plan("gpt-1008b", "a100-80gb", nodes=384, gpus_per_node=8, seq_len=2048, global_batch=3072)
        return time.perf_counter() - t0, r.model_dump_json()

    cached, cached_json = timed()
    ops = inflight._interleaved_events, inflight._zbv_events
    inflight._interleaved_events, inflight._zbv_events = (f.__wrapped__ for f in ops)  # the orders rebuilt every call
    try:
        rebuilt, rebuilt_json = timed()
    finally:
        inflight._interleaved_events, inflight._zbv_events = ops
    assert cached_json == rebuilt_json, "the cached op orders changed the plan"
    print(
        f"\nplan gpt-1008b on 3,072 × a100-80gb: {cached:.2f} s with cached schedule orders, {rebuilt:.2f} s "
        f"rebuilding them per candidate (ratio {cached / rebuilt:.2f}); the same plan both ways"
    )


if __name__ == "__main__":
    main()
