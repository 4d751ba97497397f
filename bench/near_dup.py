"""Near-dup + quality filters: nightloom's (nightloom/sharding/near_dup.py, filters.py) against datatrove's MinHash
pipeline (FineWeb's 4 stages: signatures, buckets, clusters, filter) and its filters, on the same corpus.

The corpus is `nightloom.sharding.planted` (planted near-duplicates at 5-gram Jaccard 0.75-0.95, exact copies,
boilerplate-sharing hard negatives), written as JSONL. Each route runs in a fresh subprocess, so its wall time,
CPU time and peak RSS are its own; each reads the JSONL itself, streamed (nightloom:
near_dup_clusters.near_duplicates_streamed, band keys spilled as the shard stage spills them). Both sides use one
process, one thread (datatrove's LocalPipelineExecutor with workers=1); datatrove's filters, word tokenizer and
MinHash settings come from bench/_datatrove.py, which the filter test shares. Prints docs/s, peak RSS, the ratios, and recall / lost
groups of the planted duplicates for both.

    python bench/near_dup.py --originals 20000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench._datatrove when run as a script

PEAK = """
def peak_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
"""

CHILD = {
    "nightloom": PEAK
    + """
import sys, json, orjson, numpy as np
from pathlib import Path
from nightloom.sharding.near_dup_clusters import near_duplicates_streamed
src, out, filters = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
n = sum(1 for _ in open(src, "rb"))
removed = np.zeros(n, dtype=bool)
spec = None
if filters:
    from nightloom.sharding.filters import check
    from nightloom.spec.quality import FiltersSpec
    spec = FiltersSpec.published()
def docs():  # read once, streamed: no text kept past its batch
    for i, line in enumerate(open(src, "rb")):
        text = orjson.loads(line)["text"]
        if spec is not None and check(text, spec) is not None:
            removed[i] = True
        else:
            yield i, text
removed[near_duplicates_streamed(docs(), n, Path(out + ".work"))] = True
np.save(out, removed)
print(json.dumps({"peak_mib": peak_mib()}))
""",
    "datatrove": PEAK
    + """
import sys, json, numpy as np, orjson
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.pipeline.dedup.minhash import (MinhashDedupSignature, MinhashDedupBuckets, MinhashDedupCluster,
    MinhashDedupFilter)
from bench._datatrove import Words, datatrove_filters, minhash_config

src, out, filters = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
conf = json.loads(sys.argv[4])  # bench/_datatrove.py's kwargs, made by the parent from nightloom's settings
tok, work = Words(), out + ".work"
cfg = minhash_config(conf["minhash"])
reader = JsonlReader(src, doc_progress=False)
pre = list(datatrove_filters(conf["filters"]).values()) if filters else []
run = lambda steps, tasks=1: LocalPipelineExecutor(steps, tasks=tasks, workers=1, logging_dir=work + "/logs",
                                                   skip_completed=False).run()
run([reader, *pre, MinhashDedupSignature(work + "/sigs", config=cfg, language=tok)])
run([MinhashDedupBuckets(work + "/sigs", work + "/buckets", config=cfg)], tasks=cfg.num_buckets)
run([MinhashDedupCluster(work + "/buckets", work + "/remove", config=cfg)])
run([JsonlReader(src, doc_progress=False), *pre, MinhashDedupFilter(work + "/remove"),
     JsonlWriter(work + "/kept", compression=None)])
import glob
kept = {orjson.loads(l)["id"] for f in glob.glob(work + "/kept/*.jsonl") for l in open(f, "rb")}
n = sum(1 for _ in open(src, "rb"))
np.save(out, np.array([str(i) not in kept for i in range(n)]))
print(json.dumps({"peak_mib": peak_mib()}))
""",
}


def run_child(route: str, *args: str) -> dict:
    t0, c0 = time.perf_counter(), os.times()
    p = subprocess.run(
        [sys.executable, "-c", CHILD[route], *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    wall, c1 = time.perf_counter() - t0, os.times()
    if p.returncode:
        raise SystemExit(f"{route} failed:\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res.update(wall_s=wall, cpu_s=(c1.children_user - c0.children_user) + (c1.children_system - c0.children_system))
    return res


def quality(removed, group) -> tuple[float, int]:
    """(recall of planted duplicates, groups that lost every document) from a removed mask."""
    import numpy as np

    g = np.asarray(group)
    size = np.bincount(g)
    kept = np.bincount(g[~removed], minlength=len(size))
    return float((size - np.maximum(kept, 1)).sum() / max(1, (size - 1).sum())), int((kept == 0).sum())


def main() -> None:
    import numpy as np

    from bench._datatrove import filter_kwargs, minhash_kwargs
    from nightloom.sharding.planted import planted_corpus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--originals", type=int, default=5000, help="original documents (the corpus is ~1.7x)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    corpus = planted_corpus(a.originals, seed=a.seed)
    conf = json.dumps({"filters": filter_kwargs(), "minhash": minhash_kwargs()})
    n = len(corpus.texts)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "corpus.jsonl"
        with open(src, "w") as f:
            for i, t in enumerate(corpus.texts):
                f.write(json.dumps({"id": str(i), "text": t}) + "\n")
        mb = src.stat().st_size / 2**20
        print(f"corpus: {n} documents, {mb:.1f} MiB, {a.originals} originals")
        rows = []
        for filters in ("0", "1"):
            res = {}
            for route in ("datatrove", "nightloom"):
                out = str(Path(tmp) / f"{route}-{filters}.npy")
                res[route] = r = run_child(route, str(src), out, filters, conf)
                removed = np.load(out)
                r["removed"] = int(removed.sum())
                if filters == "0":
                    r["recall"], r["lost"] = quality(removed, corpus.group)
            what = "near-dup" if filters == "0" else "filters + near-dup"
            for route, r in res.items():
                extra = f", recall {r['recall']:.3f}, groups lost {r['lost']}" if "recall" in r else ""
                print(
                    f"{what:>20} {route:>9}: {n / r['wall_s']:8.0f} docs/s  {r['cpu_s']:6.1f} CPU s  "
                    f"peak {r['peak_mib']:6.0f} MiB  removed {r['removed']}{extra}"
                )
            d, m = res["datatrove"], res["nightloom"]
            rows.append(
                f"| {what} | {n / d['wall_s']:.0f} | {n / m['wall_s']:.0f} | {d['wall_s'] / m['wall_s']:.2f}x "
                f"| {d['peak_mib']:.0f} | {m['peak_mib']:.0f} | {m['peak_mib'] / d['peak_mib']:.2f}x |"
            )
        print(
            "\n| route | datatrove docs/s | nightloom docs/s | speed ratio | datatrove MiB | nightloom MiB | memory ratio |"
        )
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
