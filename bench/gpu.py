"""One prepared script for a machine with a GPU: a 1B-class Llama from a Hugging Face config, trained, then the
gpu-marked tests.

1. Train: `python -m nightloom.train` on one GPU, bf16, ~50 steps of a Llama-3.2-1B-shaped model built from its
   config.json (random weights: nothing is downloaded); prints tokens/s, MFU against the datasheet peak of the
   GPU found (nightloom.catalog) and peak memory, from the run's metrics.jsonl (steps after warm-up).
2. Import speed: the same model's random weights saved as bf16 safetensors (shards + index), loaded into the
   model on the GPU by nightloom.hf.load (DCP HuggingFaceStorageReader), against reading the same files with
   `safetensors` alone: MB/s and the ratio, in one run.
3. `pytest -m gpu tests/gpu` (bf16 import/train/export paths and the trainer on CUDA).

Usage: .venv/bin/python bench/gpu.py [--steps 50] [--seq-len 2048] [--micro-batch 4] [--skip-tests]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

#: Llama-3.2-1B's published config.json (architecture fields only).
LLAMA_1B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
WORDS = "the night loom weaves long threads of data into models while the cluster sleeps and gradients flow".split()


def corpus(folder: Path, mib: int = 4) -> Path:
    """Parquet shards of random word text + manifest.json (byte tokens), enough for the steps asked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nightloom.sharding.manifest import ShardInfo, ShardManifest

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    infos, rows, toks, nbytes = [], 0, 0, 0
    for i in range(4):
        docs = []
        while sum(len(d) for d in docs) < mib * 2**20 // 4:
            docs.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400))))
        name = f"shard-{i:05d}.parquet"
        pq.write_table(pa.table({"text": docs}), folder / name)
        data = (folder / name).read_bytes()
        t = sum(len(d.encode()) for d in docs)
        infos.append(
            ShardInfo(
                index=i, path=name, rows=len(docs), tokens=t, bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
            )
        )
        rows, toks, nbytes = rows + len(docs), toks + t, nbytes + len(data)
    m = ShardManifest(
        num_shards=4, key="<text>", salt="bench", imbalance=0.0, imbalance_before_rebalance=0.0, balanced=True,
        rows=rows, tokens=toks, bytes=nbytes, shards=infos,
    )  # fmt: skip
    (folder / "manifest.json").write_text(m.to_json(), encoding="utf-8")
    return folder


def gpu_spec():
    from nightloom.catalog import GPUS

    name = torch.cuda.get_device_name(0).lower()
    for key in ("h200", "h100", "h800", "h20", "a800", "l40s", "4090"):
        if key in name:
            return GPUS[{"h100": "h100-80gb", "4090": "rtx-4090", "a800": "a800-80gb"}.get(key, key)]
    if "a100" in name:
        return GPUS["a100-80gb" if torch.cuda.get_device_properties(0).total_memory > 50 * 2**30 else "a100-40gb"]
    return None


def train(tmp: Path, args) -> None:
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.metrics import read_metrics
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    cfg = tmp / "llama-1b" / "config.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(json.dumps(LLAMA_1B))
    gpu = gpu_spec()
    run = tmp / "run"
    run.mkdir()
    job = TrainJob(
        run_id="bench-gpu",
        run_dir=str(run),
        model=(shape_from_hf_config(cfg)),
        plan=ParallelPlan(micro_batch=args.micro_batch, grad_accum=1),
        train=TrainSpec(
            steps=args.steps,
            seq_len=args.seq_len,
            global_batch=args.micro_batch,
            lr=3e-4,
            warmup_steps=5,
            precision="bf16",
            export="none",
        ),  # fmt: skip
        manifest=str(corpus(tmp / "corpus")),
        peak_flops=gpu.peak("bf16") if gpu else None,
        peak_source=f"datasheet: {gpu.source}" if gpu else None,
        hf_config=str(cfg),
    )
    (run / "job.json").write_text(job.model_dump_json(indent=2))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "nightloom.train", "--job", str(run / "job.json")], cwd=ROOT, check=False)
    if p.returncode:
        raise SystemExit(f"training failed (exit {p.returncode})")
    m = read_metrics(run / "metrics.jsonl")[5:]
    print(f"\n== train: Llama-3.2-1B shape, 1 GPU ({torch.cuda.get_device_name(0)}), bf16, "
          f"{args.micro_batch}x{args.seq_len} tokens/step, {args.steps} steps in {time.perf_counter() - t0:.0f} s")  # fmt: skip
    print(f"tokens/s (median after 5 steps): {statistics.median(x.tokens_per_s for x in m):,.0f}")
    print(f"MFU (PaLM App. B, {job.peak_source or 'measured peak'}): {statistics.median(x.mfu for x in m):.1%}")
    print(f"peak memory: {max(x.peak_mem_bytes for x in m) / 2**30:.1f} GiB; loss {m[0].loss:.3f} -> {m[-1].loss:.3f}")


def import_speed(tmp: Path) -> None:
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from nightloom.hf.config import shape_from_hf_config
    from nightloom.hf.load import load_hf_weights
    from nightloom.train.model import build_model

    folder = tmp / "weights"
    cfg = {k: v for k, v in LLAMA_1B.items() if k not in ("model_type", "architectures")}
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig(**cfg, dtype="bfloat16")).to(torch.bfloat16)
    hf.save_pretrained(folder, max_shard_size="500MB")
    del hf
    files = sorted(folder.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files) / 2**20
    t0 = time.perf_counter()
    for f in files:
        load_file(str(f), device="cuda")
    torch.cuda.synchronize()
    plain = time.perf_counter() - t0
    shape = shape_from_hf_config(folder)
    model = build_model(shape, 2048, device="meta").to_empty(device="cuda")
    model.init_weights(0)
    model.to(torch.bfloat16)
    t0 = time.perf_counter()
    load_hf_weights([model], folder, shape)
    torch.cuda.synchronize()
    ours = time.perf_counter() - t0
    print(
        f"\n== import: {size:.0f} MiB of bf16 safetensors in {len(files)} files (page cache warm after the first read)"
    )
    print(f"safetensors.load_file alone: {size / plain:,.0f} MiB/s; nightloom.hf.load (DCP reader): "
          f"{size / ours:,.0f} MiB/s; ratio {ours / plain:.2f}x the time")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        train(Path(d), args)
        import_speed(Path(d))
    if args.skip_tests:
        return 0
    print("\n== pytest -m gpu tests/gpu", flush=True)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"], cwd=ROOT, check=False
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
