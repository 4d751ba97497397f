"""Sharding throughput and memory: nightloom vs raw read+parse vs `datasets` load + shard + to_parquet.

Generates skewed JSONL (Pareto document lengths, ~10% exact duplicates), then times, each in a fresh
subprocess (so peak RSS is its own): (a) raw read + JSON parse of every line (the practical limit: the sharder
must at least do this), (b) nightloom.sharding.shard_dataset into N shards, (c) datasets.load_dataset("json")
+ Dataset.shard + to_parquet into the same N. Prints MB/s, the ratios, and nightloom's peak RSS at two sizes.

    python bench/sharding.py --size-mb 1024 --shards 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = {
    "raw": """
import orjson, sys
n = 0
with open(sys.argv[1], "rb", buffering=1 << 20) as f:
    for line in f:
        n += len(orjson.loads(line)["text"])
""",
    "nightloom": """
import sys
from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec
m = shard_dataset(DatasetSpec(path=sys.argv[1]), ShardingSpec(output=sys.argv[2], num_shards=int(sys.argv[3]),
                  tolerance=0.02), workers=int(sys.argv[4]))
print("IMBALANCE", m.imbalance_before_rebalance, m.imbalance, m.dedup_dropped, m.rows, file=sys.stderr)
""",
    "datasets": """
import sys, os
from datasets import load_dataset
ds = load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[2] + "/cache")
n = int(sys.argv[3])
for i in range(n):
    ds.shard(num_shards=n, index=i).to_parquet(f"{sys.argv[2]}/shard-{i:05d}.parquet")
""",
}
RSS = "\nimport resource, sys; print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"


def make_corpus(path: Path, size_mb: float, seed: int = 0) -> int:
    """Skewed JSONL: Pareto lengths (median ~0.6 KB, tail to 200 KB), ~10% exact duplicates of earlier lines."""
    rng = random.Random(seed)
    vocab = [f"w{i}" if i % 7 else f"λ{i}" for i in range(5000)]
    pool = [" ".join(rng.choices(vocab, k=min(int(rng.paretovariate(1.1) * 60), 30000))) for _ in range(4000)]
    target = int(size_mb * 1024 * 1024)
    recent: list[bytes] = []
    written = i = 0
    with open(path, "wb", buffering=1 << 22) as f:
        while written < target:
            if recent and rng.random() < 0.10:
                line = recent[rng.randrange(len(recent))]
            else:
                line = (
                    json.dumps(
                        {"id": i, "text": f"document {i}. " + pool[rng.randrange(len(pool))]}, ensure_ascii=False
                    ).encode()
                    + b"\n"
                )
                if len(recent) < 2000:
                    recent.append(line)
                else:
                    recent[rng.randrange(2000)] = line
            f.write(line)
            written += len(line)
            i += 1
    return written


def run_child(kind: str, *args: str) -> tuple[float, int, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TQDM_DISABLE="1",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
    )
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", CHILD[kind] + RSS, *args], env=env, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{kind} failed:\n{p.stderr[-3000:]}")
    rss = int(next(ln.split()[1] for ln in p.stderr.splitlines() if ln.startswith("PEAK_RSS_KB")))
    extra = next((ln for ln in p.stderr.splitlines() if ln.startswith("IMBALANCE")), "")
    return wall, rss, extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024, help="corpus size (default 1 GiB)")
    ap.add_argument("--small-mb", type=float, default=None, help="second size for the RSS check (default size/4)")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--skip-datasets", action="store_true")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp dir, removed after)")
    a = ap.parse_args()
    small_mb = a.small_mb or a.size_mb / 4
    scratch = Path(a.dir or tempfile.mkdtemp(prefix="nl-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        big, small = scratch / "big.jsonl", scratch / "small.jsonl"
        t = time.perf_counter()
        nbig = make_corpus(big, a.size_mb, seed=1)
        nsmall = make_corpus(small, small_mb, seed=2)
        print(
            f"corpus: {nbig / 2**20:.0f} MiB and {nsmall / 2**20:.0f} MiB generated in {time.perf_counter() - t:.1f} s"
        )
        mb = nbig / 2**20
        raw_t, raw_rss, _ = run_child("raw", str(big))
        nl_t, nl_rss, info = run_child("nightloom", str(big), str(scratch / "out"), str(a.shards), str(a.workers))
        shutil.rmtree(scratch / "out", ignore_errors=True)
        _, nl_small_rss, _ = run_child(
            "nightloom", str(small), str(scratch / "out-s"), str(a.shards), str(a.workers)
        )
        shutil.rmtree(scratch / "out-s", ignore_errors=True)
        print(f"nightloom: {info}  (imbalance plain → final, duplicates dropped, rows)")
        print(f"(a) raw read+parse   {mb / raw_t:7.1f} MB/s  ({raw_t:.1f} s, peak RSS {raw_rss / 1024:.0f} MiB)")
        print(f"(b) nightloom shard  {mb / nl_t:7.1f} MB/s  ({nl_t:.1f} s, peak RSS {nl_rss / 1024:.0f} MiB)")
        print(f"    ratio nightloom / raw read+parse = {raw_t / nl_t:.2f}  (target ≥ 0.7)")
        if not a.skip_datasets:
            ds_t, ds_rss, _ = run_child("datasets", str(big), str(scratch / "hf"), str(a.shards))
            shutil.rmtree(scratch / "hf", ignore_errors=True)
            print(
                f"(c) datasets load+shard+to_parquet {mb / ds_t:7.1f} MB/s  ({ds_t:.1f} s, peak RSS {ds_rss / 1024:.0f} MiB)"
            )
            print(f"    ratio nightloom / datasets = {ds_t / nl_t:.2f}  (target > 1)")
        print(
            f"peak RSS nightloom: {nsmall / 2**20:.0f} MiB corpus → {nl_small_rss / 1024:.0f} MiB; "
            f"{mb:.0f} MiB corpus → {nl_rss / 1024:.0f} MiB  (ratio {nl_rss / nl_small_rss:.2f} for "
            f"{nbig / nsmall:.1f}× the data)"
        )
    finally:
        if a.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
