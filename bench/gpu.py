"""One prepared script for a machine with a GPU: a 1B-class Llama trained in each precision and compile setting,
beside torchtitan's published H100 figures, then import speed and the gpu-marked tests.

1. Train grid: `python -m nightloom.train` on one GPU, a Llama-3.2-1B-shaped model built from its config.json
   (random weights: nothing is downloaded), ~50 steps each of bf16 and fp8 (train.precision, torchao tensorwise),
   with train.compile off and on. Per run: tokens/s and MFU (median after the warm-up steps), MFU against the bf16
   datasheet peak and, for fp8, also against the FP8 peak (each labelled), peak memory; then torchtitan's
   published Llama 3.1 8B figures on 8 H100 (docs/performance.md of pytorch/torchtitan, Table 1, FSDP, local
   batch 2, selective AC, TPS/GPU: FSDP 5,762; + torch.compile 6,667; + torch.compile + Float8 8,532) with
   their ratios beside ours. Different model and GPU count: compare the ratios, not the absolute numbers.
2. Import speed: the same model's random weights saved as bf16 safetensors (shards + index), loaded into the
   model on the GPU by nightloom.hf.load (DCP HuggingFaceStorageReader), against reading the same files with
   `safetensors` alone: MB/s and the ratio, in one run.
3. Rollout engines (train.grpo.engine), when vllm (0.32.0) is importable: the same model's greedy rollout of 32
   prompts x 128 new tokens by native generation and by vLLM colocated in this process (tokens/s and the ratio,
   in one run, bf16), and one weight push to vLLM (nightloom.train.rollout.push.hf_state + load_weights) timed.
4. `pytest -m gpu tests/gpu` (bf16 and fp8 train/import/export paths, the trainer and the vllm engine on CUDA).

`--smoke` runs step 1 on a CPU in seconds: the catalog `tiny` model, fp32, 3 steps, compile off and on (fp8 is
listed as refused: GPU only); what tests/unit/repo/test_bench_gpu_smoke.py runs (with --no-compile).

Usage: .venv/bin/python bench/gpu.py [--steps 50] [--seq-len 2048] [--micro-batch 4] [--skip-tests] [--smoke]
       [--no-compile] [--no-fp8]
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
from dataclasses import dataclass
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


#: torchtitan docs/performance.md, Table 1: Llama 3.1 8B, 8 H100 (96 GB HBM2e, 500 W), FSDP, local batch 2, global
#: batch 16, selective activation checkpointing; tokens/s per GPU and memory (GiB). The page reports no MFU for
#: Float8 runs, and 33% to 39% MFU for 1D Llama 3.1 8B without Float8 (with / without torch.compile).
TORCHTITAN_H100_8B = (
    ("FSDP", 5762, 82.4),
    ("FSDP + torch.compile", 6667, 77.0),
    ("FSDP + compile + Float8", 8532, 76.8),
)


@dataclass
class Variant:
    precision: str  # bf16, fp8 (GPU) or fp32 (--smoke on CPU)
    compile: bool

    @property
    def name(self) -> str:
        return f"{self.precision}{' + compile' if self.compile else ''}"


def variants(args, cuda: bool) -> list[Variant]:
    precisions = ["bf16"] + ([] if args.no_fp8 else ["fp8"]) if cuda else ["fp32"]
    compiles = [False] if args.no_compile else [False, True]
    return [Variant(p, c) for p in precisions for c in compiles]


def train_one(tmp: Path, args, v: Variant, manifest: Path, shape, hf_config: str | None, gpu) -> dict | None:
    """One trainer run of variant `v`; its medians after the warm-up steps (None: it failed, output shown)."""
    from nightloom.metrics import read_metrics
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    run = tmp / f"run-{v.precision}-{int(v.compile)}"
    run.mkdir()
    warm = min(5, args.steps - 1)
    job = TrainJob(
        run_id=f"bench-gpu-{v.precision}-{int(v.compile)}",
        run_dir=str(run),
        model=shape,
        plan=ParallelPlan(micro_batch=args.micro_batch, grad_accum=1),
        train=TrainSpec(
            steps=args.steps,
            seq_len=args.seq_len,
            global_batch=args.micro_batch,
            lr=3e-4,
            warmup_steps=warm,
            precision=v.precision,
            compile=v.compile,
            export="none",
        ),  # fmt: skip
        manifest=str(manifest),
        peak_flops=gpu.peak("bf16") if gpu else None,  # MFU against the bf16 peak; fp8's is printed beside
        peak_source=f"datasheet bf16: {gpu.source}" if gpu else None,
        hf_config=hf_config,
    )
    (run / "job.json").write_text(job.model_dump_json(indent=2))
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-m", "nightloom.train", "--job", str(run / "job.json")],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if p.returncode:
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        print(f"  {v.name:16s} failed (exit {p.returncode}): {' | '.join(tail)[-400:]}")
        return None
    m = read_metrics(run / "metrics.jsonl")[warm:]
    out = {
        "tps": statistics.median(x.tokens_per_s for x in m),
        "mfu_bf16": statistics.median(x.mfu for x in m),
        "mem": max(x.peak_mem_bytes for x in m),
        "loss": (m[0].loss, m[-1].loss),
        "wall": time.perf_counter() - t0,
    }
    if v.precision == "fp8" and gpu is not None:
        out["mfu_fp8"] = out["mfu_bf16"] * gpu.peak("bf16") / gpu.peak("fp8")
    return out


def train(tmp: Path, args) -> dict[str, dict | None]:
    """The grid of step 1; prints one line per variant and torchtitan's figures; returns the results by name."""
    from nightloom.catalog import get_model
    from nightloom.hf.config import shape_from_hf_config

    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        cfg = tmp / "llama-1b" / "config.json"
        cfg.parent.mkdir(parents=True)
        cfg.write_text(json.dumps(LLAMA_1B))
        shape, hf_config, gpu = shape_from_hf_config(cfg), str(cfg), gpu_spec()
        manifest = corpus(tmp / "corpus")
        where = f"1 GPU ({torch.cuda.get_device_name(0)})"
    else:
        from bench._support import write_corpus

        shape, hf_config, gpu = get_model("tiny"), None, None
        manifest = write_corpus(tmp / "corpus")
        where = "CPU smoke (catalog tiny, fp32; MFU against the measured CPU matmul peak)"
    print(f"\n== train: {shape.name} shape, {where}, {args.micro_batch}x{args.seq_len} tokens/step, {args.steps} "
          f"steps per variant, medians after warm-up")  # fmt: skip
    results: dict[str, dict | None] = {}
    for v in variants(args, cuda):
        r = results[v.name] = train_one(tmp, args, v, manifest, shape, hf_config, gpu)
        if r is None:
            continue
        mfu = f"MFU {r['mfu_bf16']:.1%} of the {'bf16 datasheet' if gpu else 'measured'} peak"
        if "mfu_fp8" in r:
            mfu += f", {r['mfu_fp8']:.1%} of the FP8 peak"
        print(f"  {v.name:16s} tokens/s {r['tps']:>10,.0f}   {mfu}   peak mem {r['mem'] / 2**30:.2f} GiB   "
              f"loss {r['loss'][0]:.3f} -> {r['loss'][1]:.3f}   ({r['wall']:.0f} s)")  # fmt: skip
    if not cuda and not args.no_fp8:
        print("  fp8              not run: train.precision fp8 needs a CUDA GPU (the trainer refuses it on a CPU)")
    base = results.get(variants(args, cuda)[0].name)
    print("torchtitan, docs/performance.md Table 1 (Llama 3.1 8B, 8 H100, FSDP, local batch 2, selective AC):")
    for name, tps, mem in TORCHTITAN_H100_8B:
        print(f"  {name:26s} TPS/GPU {tps:>6,}  ({tps / TORCHTITAN_H100_8B[0][1]:.2f}x FSDP)  memory {mem} GiB")
    if base:
        ratios = ", ".join(f"{k} {r['tps'] / base['tps']:.2f}x" for k, r in results.items() if r)
        print(f"ours, tokens/s against {variants(args, cuda)[0].name}: {ratios}")
    return results


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


def rollout_engines(tmp: Path) -> None:
    """Native generation against the colocated vLLM engine on the weights import_speed saved (tmp/weights)."""
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        print("\n== rollout engines: vllm is not installed here (pip install vllm==0.32.0): native only, skipped")
        return
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.hf.load import model_from_hf
    from nightloom.spec.grpo import VLLMSpec
    from nightloom.train.rollout.engine import GroupDraw, NativeEngine
    from nightloom.train.rollout.sampling import SamplingParams
    from nightloom.train.rollout.vllm_engine import VLLMEngine, model_folder

    folder, batch, new = tmp / "weights", 32, 128
    shape = shape_from_hf_config(folder)
    model = model_from_hf(folder, 512).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, shape.vocab, (16 + (7 * i) % 48,), generator=g).tolist() for i in range(batch)]
    params, draw = SamplingParams(max_new_tokens=new, temperature=0.0), GroupDraw(0, 0, 0, batch, 1)
    eos = [shape.vocab + 1]  # no row ends early: exactly `new` tokens each
    engine = VLLMEngine(model_folder(shape, str(folder / "config.json"), None, "bf16"), shape, VLLMSpec(), seed=0,
                        max_model_len=512, dtype="bf16", eos_ids=eos, pad_id=0)  # fmt: skip
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.sync(model, 0)
    torch.cuda.synchronize()
    push = time.perf_counter() - t0
    native = NativeEngine(eos, 0, None)
    times: dict[str, list[float]] = {"native": [], "vllm": []}
    for _ in range(3):  # interleaved; the first round warms both
        for name, e in (("native", native), ("vllm", engine)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            e.generate(model, prompts, params, draw)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    tps = {k: batch * new / statistics.median(v[1:]) for k, v in times.items()}
    print(f"\n== rollout engines: {batch} prompts x {new} new tokens, greedy, bf16, one GPU")
    print(f"native generation {tps['native']:,.0f} tokens/s; vLLM colocated {tps['vllm']:,.0f} tokens/s; "
          f"ratio {tps['vllm'] / tps['native']:.2f}x; one weight push to vLLM {push:.2f} s")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, fp32, 3 steps, no import or tests")
    ap.add_argument("--no-compile", action="store_true", help="only train.compile off")
    ap.add_argument("--no-fp8", action="store_true", help="only bf16")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.smoke:
        args.steps, args.seq_len, args.micro_batch = 3, 32, 2
        with tempfile.TemporaryDirectory() as d:
            results = train(Path(d), args)
        return 0 if results and all(r is not None for r in results.values()) else 1
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; run it on a GPU machine (or --smoke on a CPU)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        train(Path(d), args)
        import_speed(Path(d))
        rollout_engines(Path(d))
    if args.skip_tests:
        return 0
    print("\n== pytest -m gpu tests/gpu", flush=True)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"], cwd=ROOT, check=False
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
