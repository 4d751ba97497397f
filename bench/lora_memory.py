"""Peak memory (and tokens/s) of LoRA against full fine-tuning on the same model, measured in one run.

Both train the same ~94M-parameter Llama-shaped model (8 layers, hidden 1024, fp32, AdamW) for a few steps on the
same byte corpus in one process each (fresh processes, so each peak is its own): full fine-tuning holds weights,
gradients and two Adam moments for every parameter; LoRA (rank 16 on every linear) holds the frozen weights and
only the adapters' gradients and moments. The trainer's own peak (the process's RSS high-water mark since step 1,
metrics.jsonl peak_mem_bytes) is compared, with the planner's per-rank prediction for the same two jobs beside it.
Printed as ratios: CPU RSS includes the interpreter and torch (~0.3 GiB), which a GPU's allocator peak does not.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/lora_memory.py [--steps 3] [--rank 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._support import launch, make_job, write_corpus  # noqa: E402
from nightloom.shape import ModelShape  # noqa: E402

SHAPE = ModelShape("bench-94m", 8, 1024, 16, 8, 2816, 256, 1024)


def predicted(rank: int | None, seq_len: int, batch: int):
    """The planner's memory breakdown of this job on one rank (fp32), with or without LoRA."""
    from nightloom.parallel import ParallelPlan
    from nightloom.planner.memory import memory_breakdown

    return memory_breakdown(SHAPE, ParallelPlan(micro_batch=batch).dims(), seq_len, "fp32", lora_rank=rank)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(Path(tmp) / "corpus", shards=2, docs_per_shard=200)
        for name, extra in (("full", None), ("lora", {"lora": {"rank": a.rank, "alpha": 2.0 * a.rank}})):
            job = make_job(
                Path(tmp) / name,
                corpus,
                model="",
                shape=SHAPE,
                steps=a.steps,
                seq_len=a.seq_len,
                global_batch=a.batch,
                timeout_s=600,
                peak_flops=50e9,
                peak_source="bench constant",
                train_extra=extra,
                micro_batch=a.batch,
            )
            runs[name] = launch(1, job, timeout=1800)
    peak = {k: max(m.peak_mem_bytes for m in r.metrics) / 2**30 for k, r in runs.items()}
    tps = {k: statistics.median(m.tokens_per_s for m in r.metrics[1:] or r.metrics) for k, r in runs.items()}
    print(
        f"model {SHAPE.name}: {SHAPE.layers} layers, hidden {SHAPE.hidden}; fp32 AdamW; {a.steps} steps of {a.batch}x{a.seq_len}"
    )
    plan = {"full": predicted(None, a.seq_len, a.batch), "lora": predicted(a.rank, a.seq_len, a.batch)}
    for k in runs:
        p = plan[k]
        states = p.weights_gib + p.grads_gib + p.optimizer_gib
        print(
            f"  {k:5s} peak RSS {peak[k]:.2f} GiB   tokens/s {tps[k]:,.0f}   planner: weights+grads+optimizer "
            f"{states:.2f} GiB (grads {p.grads_gib:.3f}, optimizer {p.optimizer_gib:.3f})"
        )
    ps = {k: plan[k].weights_gib + plan[k].grads_gib + plan[k].optimizer_gib for k in plan}
    print(
        f"full - LoRA: {peak['full'] - peak['lora']:.2f} GiB measured, {ps['full'] - ps['lora']:.2f} GiB planned "
        "(the gradients and Adam moments of the frozen base)"
    )
    print(
        f"LoRA / full: peak memory {peak['lora'] / peak['full']:.2f}x measured, model states "
        f"{ps['lora'] / ps['full']:.2f}x planned; tokens/s {tps['lora'] / tps['full']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
