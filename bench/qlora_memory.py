"""QLoRA against 16-bit LoRA on the same model, measured in one run: the frozen base's resident bytes, the step time,
and an adapter-only checkpoint's size against a full one.

One ~94M-parameter Llama-shaped model (8 layers, hidden 1024), LoRA rank 16 on every linear, built twice in this
process: the base in bf16 (16-bit LoRA) and the base's linears in nf4 with double quantization (train/qlora.py,
bitsandbytes' CPU kernels), both computing in bf16 under autocast with fp32 adapters. Resident bytes are the base's
own tensors (every frozen parameter and buffer, as stored); the step time is the median of a few forward+backward
+AdamW steps on the same batch; the checkpoints are written by train/checkpoint.save on a one-rank group, with and
without `adapters_only`. Target: the base at most 0.35x of the 16-bit one.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/qlora_memory.py [--steps 4] [--rank 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nightloom.shape import ModelShape  # noqa: E402
from nightloom.train import checkpoint  # noqa: E402
from nightloom.train.lora import LoraSettings, apply_lora, init_lora, trainable  # noqa: E402
from nightloom.train.model import build_model  # noqa: E402
from nightloom.train.parallelize import loss_fn  # noqa: E402
from nightloom.train.qlora import QuantSettings, base_bytes, init_quantized, quantize_base  # noqa: E402

SHAPE = ModelShape("bench-94m", 8, 1024, 16, 8, 2816, 256, 1024)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(rank: int, quant: QuantSettings | None) -> torch.nn.Module:
    """The model with LoRA adapters; its base in bf16, or its linears quantized."""
    lora = LoraSettings(rank, 2.0 * rank, 0.0, MODULES, quant)
    model = build_model(SHAPE, 256, device="meta")
    if quant is not None:
        quantize_base(model, quant)
    apply_lora(model, lora)
    model.to_empty(device="cpu")
    model.init_weights(0)
    init_lora(model, 0)
    if quant is not None:
        init_quantized(model, 0)
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)  # the 16-bit base (and a QLoRA run's norms, embedding, head)
    return model


def step_times(model: torch.nn.Module, steps: int, batch: int, seq: int) -> tuple[float, torch.optim.Optimizer]:
    """(median seconds of one forward + backward + AdamW step on a fixed batch, the optimizer)."""
    opt = torch.optim.AdamW(trainable(model), lr=1e-4)
    ids = torch.randint(0, SHAPE.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(ids[:, :-1]).float(), ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times), opt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    nf4 = QuantSettings("nf4", True, torch.bfloat16)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, quant in (("lora-bf16", None), ("qlora-nf4", nf4)):
            model = build(a.rank, quant)
            secs, opt = step_times(model, a.steps, a.batch, a.seq_len)
            full, _ = checkpoint.save(Path(tmp) / name / "full", 1, [model], [opt], 0)
            only, _ = checkpoint.save(Path(tmp) / name / "adapters", 1, [model], [opt], 0, {"adapters_only": True})
            rows[name] = (base_bytes(model), secs, checkpoint.size_bytes(full), checkpoint.size_bytes(only))
            del model, opt
    dist.destroy_process_group()
    print(f"{'run':<10} {'base MiB':>9} {'step s':>8} {'full ckpt MiB':>14} {'adapter ckpt MiB':>17}")
    for name, (base, secs, full, only) in rows.items():
        print(f"{name:<10} {base / 2**20:>9.1f} {secs:>8.3f} {full / 2**20:>14.1f} {only / 2**20:>17.2f}")
    (b16, t16, f16, _), (bq, tq, fq, oq) = rows["lora-bf16"], rows["qlora-nf4"]
    print(f"QLoRA base / 16-bit base: {bq / b16:.3f}x (target <= 0.35x)")
    print(f"QLoRA step time / 16-bit LoRA step time: {tq / t16:.2f}x")
    print(f"adapter-only checkpoint / full 16-bit LoRA checkpoint: {oq / f16:.4f}x ({oq / 2**20:.2f} MiB)")
    print(f"full QLoRA checkpoint (quantized base written) / full 16-bit: {fq / f16:.3f}x")
    return 0 if bq / b16 <= 0.35 else 1


if __name__ == "__main__":
    raise SystemExit(main())
