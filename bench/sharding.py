"""Sharding throughput and memory: nightloom vs raw read+parse vs DuckDB vs `datasets` load + shard + to_parquet.

Generates skewed JSONL (Pareto document lengths, ~10% exact duplicates), then times, each in a fresh
subprocess (so peak RSS and CPU time are its own): (a) raw read + JSON parse of every line with orjson (the
practical limit: the sharder must at least do this), (b) nightloom.sharding.shard_dataset into N shards,
(c) datasets.load_dataset("json") + Dataset.shard + to_parquet into the same N, (d) DuckDB (the speed to
beat, see shared notes data-engines.md): exact dedup (SELECT DISTINCT) + hash partition into N + zstd Parquet,
with the same threads, and (f) the floor of any Arrow-based sharder: Arrow's JSON parse of the text column + one
Parquet write of it with the same codec (no hashing, dedup, balance or spill). Prints MB/s, CPU seconds, peak
RSS, the ratios, nightloom's peak RSS at two sizes, and a Markdown table of the routes.

    python bench/sharding.py --size-mb 1024 --shards 16            # the library's defaults (zstd, 1 thread/CPU)
    python bench/sharding.py --size-mb 1024 --compression none     # what the codec costs
    python bench/sharding.py --size-mb 1024 --skip-datasets --many-files 13000   # + small files vs one JSONL, and the
                                                                               # write step's cost per (unit, shard) pair
    python bench/sharding.py --tokens-only --tokens-mb 64          # tokens/s per core with a real tokenizer
    python bench/sharding.py --code-corpus .venv/lib/python3.11/site-packages   # real small files vs one JSONL
    python bench/sharding.py --s3-readahead 30     # S3 writers, 30 ms a GET: read-ahead vs one unit at a time

With `--tokens-mb N` (or `--tokens-only`): the whole shard stage with a real tokenizer (a byte-level BPE of 32k
trained with `tokenizers` on the corpus, or `--tokenizer PATH`), writing Parquet + .bin/.idx token files, against
`tokenizers`' own `encode_batch` (and `encode_batch_fast`) of the same documents on the same cores, in tokens/s
per core. The shard stage's time covers everything (parse, hash, tokenize, dedup, write); the library's only the
encode calls (reading the JSONL is not counted), so the ratio is conservative.
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
                  tolerance=0.02, compression=sys.argv[5]), workers=int(sys.argv[4]) or None)
print("IMBALANCE", m.imbalance_before_rebalance, m.imbalance, m.dedup_dropped, m.rows, file=sys.stderr)
""",
    "files": """
import sys
from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec
m = shard_dataset(DatasetSpec(path=sys.argv[1], format=sys.argv[3]), ShardingSpec(output=sys.argv[2], num_shards=16,
                  tolerance=0.05), workers=None)
print("IMBALANCE", m.imbalance_before_rebalance, m.imbalance, m.dedup_dropped, m.rows, m.files_read, file=sys.stderr)
n = len(m.sources) + m.files_ignored
print("FILES", n, m.files_read, m.files_empty, m.files_bad, m.files_duplicate, m.files_ignored, file=sys.stderr)
""",
    "datasets": """
import sys, os
from datasets import load_dataset
ds = load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[2] + "/cache")
n = int(sys.argv[3])
for i in range(n):
    ds.shard(num_shards=n, index=i).to_parquet(f"{sys.argv[2]}/shard-{i:05d}.parquet")
""",
    "duckdb": """
import os, sys, duckdb
src, out, n, threads, codec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
con = duckdb.connect()
con.execute(f"SET threads = {threads or os.cpu_count()}")
con.execute("SET preserve_insertion_order = false")
codec = "uncompressed" if codec == "none" else codec
con.execute(
    f"COPY (SELECT text, hash(text) % {n} AS shard FROM (SELECT DISTINCT text FROM "
    f"read_ndjson('{src}', columns={{'text': 'VARCHAR'}}))) "
    f"TO '{out}' (FORMAT parquet, PARTITION_BY (shard), COMPRESSION {codec})"
)
""",
    "floor": """
import sys, pyarrow as pa, pyarrow.json as pj, pyarrow.parquet as pq
from nightloom.sharding.jsonl_pieces import line_chunks
from nightloom.sharding.write import parquet_options
from pathlib import Path
schema = pa.schema([("text", pa.string())])
parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
with pq.ParquetWriter(sys.argv[2], schema, **parquet_options(sys.argv[3])) as w:
    for piece in line_chunks(Path(sys.argv[1])):
        w.write_table(pj.read_json(piece, parse_options=parse))
""",
    "pairs": """
import sys, time
from nightloom.sharding import prepare as pm
pm.UNIT_FILES = int(sys.argv[3])
from nightloom.sharding import pipeline
from nightloom.sharding.place import place_documents
from nightloom.sharding.scan import scan_unit
from nightloom.sharding.write import write_shard
from nightloom.spec import DatasetSpec, ShardingSpec
job = pipeline.plan_job(DatasetSpec(path=sys.argv[1], format="text"),
                        ShardingSpec(output=sys.argv[2], num_shards=16, tolerance=0.05))
scans = [scan_unit(job, i) for i in range(len(job.units))]
place_documents(job, scans)
t = time.perf_counter()
for i in pipeline.shard_indices(job):
    write_shard(job, scans, i)
print("PAIRS", len(job.units) * job.num_shards, time.perf_counter() - t, file=sys.stderr)
""",
}
TOKEN_CHILD = {
    "encode": """
import os, sys, time, orjson
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
with open(sys.argv[2], "rb") as f:
    texts = [orjson.loads(line)["text"] for line in f]
method = getattr(tok, sys.argv[3])
n, t0 = 0, time.perf_counter()
for a in range(0, len(texts), 8192):
    n += sum(len(e.ids) for e in method(texts[a : a + 8192]))
print("TOKENS", n, time.perf_counter() - t0, file=sys.stderr)
""",
    "shard": """
import sys, time
from nightloom.sharding import shard_dataset
from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
from nightloom.tokenizer import load_tokenizer
spec = TokenizerSpec(path=sys.argv[1])
load_tokenizer(spec)
t0 = time.perf_counter()
m = shard_dataset(DatasetSpec(path=sys.argv[2]), ShardingSpec(output=sys.argv[3], num_shards=16, tolerance=0.05),
                  workers=int(sys.argv[4]), tokenizer=spec)
dt = time.perf_counter() - t0
files = sum(1 for s in m.shards if s.token_files)
print("TOKENS", m.tokens, dt, files, file=sys.stderr)
""",
}


def train_bpe(corpus: Path, folder: Path, vocab: int = 32_000, sample_mb: float = 8) -> None:
    """A byte-level BPE trained with `tokenizers` on the first `sample_mb` of the corpus (EOS <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        seen = 0
        with open(corpus, "rb") as f:
            for line in f:
                seen += len(line)
                if seen > sample_mb * 2**20:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def token_child(kind: str, cores: int, *args: str) -> tuple[int, float, str]:
    """(tokens, seconds of the timed part, extra) of one child run with `cores` threads for Rayon and the sharder."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), RAYON_NUM_THREADS=str(cores))
    env["TOKENIZERS_PARALLELISM"] = "true"
    p = subprocess.run(
        [sys.executable, "-c", TOKEN_CHILD[kind], *args], env=env, capture_output=True, text=True, check=False
    )
    if p.returncode:
        raise SystemExit(f"{kind} failed:\n{p.stderr[-3000:]}")
    parts = next(ln for ln in p.stderr.splitlines() if ln.startswith("TOKENS")).split()
    return int(parts[1]), float(parts[2]), " ".join(parts[3:])


def token_bench(scratch: Path, size_mb: float, tokenizer: str | None, cores: int) -> None:
    """The shard stage with a real tokenizer against `tokenizers`' own batch encode: tokens/s per core."""
    corpus = scratch / "tokens.jsonl"
    make_corpus(corpus, size_mb, seed=3)
    folder = Path(tokenizer) if tokenizer else scratch / "bpe-32k"
    if tokenizer is None:
        t = time.perf_counter()
        train_bpe(corpus, folder)
        print(f"tokenizer: byte-level BPE 32k trained with `tokenizers` in {time.perf_counter() - t:.1f} s")
    mb = corpus.stat().st_size / 2**20
    best: dict[str, tuple[int, float, str]] = {}
    out = scratch / "tok-out"
    for _ in range(REPEAT):  # rounds of every route in turn: a shared machine's load drifts, not one route's
        for route in ("encode_batch", "encode_batch_fast", "shard"):
            if route == "shard":
                _remove(out)
                r = token_child("shard", cores, str(folder), str(corpus), str(out), str(cores))
                _remove(out)
            else:
                r = token_child("encode", cores, str(folder), str(corpus), route)
            if route not in best or r[1] < best[route][1]:
                best[route] = r
    runs = {k: v[:2] for k, v in best.items()}
    total = runs["encode_batch"][0]  # every document's tokens (the sharder tokenizes duplicates too, before dedup)
    kept, nl_t, files = best["shard"]
    print(f"tokens: {mb:.0f} MiB JSONL, {total:,} tokens ({kept:,} kept after dedup), {cores} core(s)")

    def row(label: str, seconds: float) -> float:
        per_core = total / seconds / cores
        print(f"{label:<44} {per_core / 1e6:6.3f} M tokens/s per core  ({seconds:.1f} s, {mb / seconds:.1f} MB/s)")
        return per_core

    nl = row(f"(t) nightloom shard (16 shards, {files} .bin/.idx)", nl_t)
    ref = row("(u) tokenizers encode_batch", runs["encode_batch"][1])
    fast = row("(v) tokenizers encode_batch_fast", runs["encode_batch_fast"][1])
    print(f"    ratio nightloom / encode_batch      = {nl / ref:.2f}  (goal ≥ 0.8)")
    print(f"    ratio nightloom / encode_batch_fast = {nl / fast:.2f}")


RSS = """
import resource, sys
u = resource.getrusage(resource.RUSAGE_SELF)
print('PEAK_RSS_KB', u.ru_maxrss, file=sys.stderr)
print('CPU_S', u.ru_utime + u.ru_stime, file=sys.stderr)
"""


def explode(jsonl: Path, folder: Path, files: int, same: Path) -> int:
    """The first `files` documents of `jsonl`, one .txt file each in 64 sub-folders (a source tree's shape), and
    the same documents as one JSONL at `same`; returns their bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    with open(jsonl, "rb") as f, open(same, "wb") as out:
        for i, line in enumerate(f):
            if i >= files:
                break
            text = json.loads(line)["text"]
            sub = folder / f"d{i % 64:02d}"
            sub.mkdir(exist_ok=True)
            (sub / f"f{i:06d}.txt").write_text(text, encoding="utf-8")
            out.write(json.dumps({"text": text}, ensure_ascii=False).encode() + b"\n")
            total += len(text.encode())
    return total


def copy_code(src: Path, folder: Path, same: Path) -> tuple[int, int]:
    """Every *.py under `src` copied to `folder` (same relative paths: many `__init__.py`, empty files, a few
    non-UTF-8 ones), and the texts of the UTF-8 ones as one JSONL at `same`; returns (files, bytes of text)."""
    files = sorted(p for p in src.rglob("*.py") if p.is_file() and not p.is_symlink())
    total = 0
    with open(same, "wb") as out:
        for p in files:
            rel = p.relative_to(src)
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            data = p.read_bytes()
            (folder / rel).write_bytes(data)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.write(json.dumps({"text": text}, ensure_ascii=False).encode() + b"\n")
            total += len(data)
    return len(files), total


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


REPEAT = 1


def run_child(kind: str, *args: str, out: Path | None = None) -> tuple[float, int, str, float]:
    """Best of REPEAT runs (wall, peak RSS KiB, extra line, CPU s): this VM's first writes to fresh pages
    cost 2-10× later ones, and every route gets the same number of tries. `out` is removed before and after
    each run (a second nightloom run into the same folder would find the manifest and do nothing)."""
    runs = []
    for _ in range(REPEAT):
        _remove(out)
        runs.append(_run_child_once(kind, *args))
        _remove(out)
    return min(runs, key=lambda r: r[0])


def _remove(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def pairs_route(folder: Path, scratch: Path) -> None:
    """The write step's fixed cost per (scan unit, shard) pair: the same text folder in units of 64 files and of
    4096 (UNIT_FILES), 16 shards, written on one thread; a corpus of thousands of units pays it units × shards
    times."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    runs = {}
    for files in (4096, 64):
        out = scratch / f"out-pairs-{files}"
        _remove(out)
        p = subprocess.run(
            [sys.executable, "-c", CHILD["pairs"], str(folder), str(out), str(files)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        _remove(out)
        if p.returncode:
            raise SystemExit(f"pairs failed:\n{p.stderr[-3000:]}")
        parts = next(ln for ln in p.stderr.splitlines() if ln.startswith("PAIRS")).split()
        runs[files] = (int(parts[1]), float(parts[2]))
    (few, few_t), (many, many_t) = runs[4096], runs[64]
    per_pair = (many_t - few_t) / (many - few) * 1e3
    print(f"write step, one thread: {few} (unit, shard) pairs {few_t:.2f} s; {many} pairs {many_t:.2f} s")
    print(f"    ratio {many_t / few_t:.2f}; each extra pair costs {per_pair:.2f} ms")


def s3_readahead_route(scratch: Path, latency_ms: float) -> None:
    """Shard writers on a machine that did not scan (an S3 work folder, an empty cache), with `latency_ms` added to
    every GET the way a far S3 endpoint adds it, one scan unit after the other (READ_AHEAD 1) against the read-ahead
    (the default): 32 input files of 500 documents, 8 shards. Needs S3_ENDPOINT_URL and AWS_* keys (for instance
    `bash .ci/services.sh start; eval "$(bash .ci/services.sh env)"`)."""
    import secrets

    import boto3

    from nightloom import storage as st
    from nightloom.sharding import pipeline, shard_dataset
    from nightloom.sharding import prepare as pm
    from nightloom.sharding import write as wm
    from nightloom.spec import DatasetSpec, ShardingSpec, StorageSpec

    url = os.environ.get("S3_ENDPOINT_URL")
    if not url:
        raise SystemExit("--s3-readahead needs S3_ENDPOINT_URL (and AWS_* keys): an S3 server to talk to")
    bucket = f"nl-bench-{secrets.token_hex(4)}"
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    corpus = scratch / "s3-corpus.jsonl"
    make_corpus(corpus, 8, seed=3)
    lines = corpus.read_bytes().splitlines(keepends=True)
    per = len(lines) // 32
    for i in range(32):
        client.put_object(Bucket=bucket, Key=f"in/p{i:02d}.jsonl", Body=b"".join(lines[i * per : (i + 1) * per]))
    storage, ds = StorageSpec(s3_endpoint_url=url), DatasetSpec(path=f"s3://{bucket}/in")
    real_write, real_read_at, real_get = pipeline.write_shard, st.RangeReader.read_at, st.get_file
    default_ahead, pm.UNIT_FILES = wm.READ_AHEAD, 1  # one file a unit: 32 units

    def later(*_):
        raise RuntimeError("the writers run on another machine")

    def slow_read_at(self, offset, n):
        time.sleep(latency_ms / 1000)
        return real_read_at(self, offset, n)

    def slow_get(*args, **kw):
        time.sleep(latency_ms / 1000)
        return real_get(*args, **kw)

    times: dict[int, list[float]] = {1: [], default_ahead: []}
    for k, ahead in enumerate([1, default_ahead] * REPEAT):
        work, sh = f"s3://{bucket}/work{k}", ShardingSpec(output=f"s3://{bucket}/out{k}", num_shards=8, tolerance=0.05)
        os.environ["NIGHTLOOM_SHARD_CACHE"] = str(scratch / f"cache-scan{k}")
        pipeline.write_shard = later
        try:
            shard_dataset(ds, sh, storage, workdir=work, workers=2)
        except RuntimeError:
            pass
        pipeline.write_shard, st.RangeReader.read_at, st.get_file = real_write, slow_read_at, slow_get
        wm.READ_AHEAD = ahead
        os.environ["NIGHTLOOM_SHARD_CACHE"] = str(scratch / f"cache-write{k}")  # another machine
        t = time.perf_counter()
        try:
            shard_dataset(ds, sh, storage, workdir=work, workers=2)
        finally:
            st.RangeReader.read_at, st.get_file, wm.READ_AHEAD = real_read_at, real_get, default_ahead
        times[ahead].append(time.perf_counter() - t)
    one, many = min(times[1]), min(times[default_ahead])
    print(f"S3 writers on another machine, {latency_ms:g} ms a GET, 32 units, 8 shards:")
    print(
        f"    one unit after the other {one:.2f} s; reading {default_ahead} ahead {many:.2f} s; ratio {one / many:.1f}"
    )


def many_files_route(label: str, folder: Path, same: Path, nbytes: int, scratch: Path) -> None:
    """Shard `folder` (one document per file, `--format text`) and `same` (the same documents as one JSONL)."""
    fmb = nbytes / 2**20
    ft, _, finfo, fcpu = run_child("files", str(folder), str(scratch / "out-f"), "text", out=scratch / "out-f")
    jt, _, _, jcpu = run_child("files", str(same), str(scratch / "out-j"), "jsonl", out=scratch / "out-j")
    print(f"{label}, {fmb:.0f} MiB of text ({finfo})")
    if FILES_LINE:
        n, read, empty, bad, dup, ignored = (int(x) for x in FILES_LINE[-1].split()[1:])
        ok = "add up" if read + empty + bad + dup + ignored == n else "DO NOT add up"
        print(f"    files: {n} = {read} read + {empty} empty + {bad} bad + {dup} duplicate + {ignored} ignored ({ok})")
    print(f"{'(g) nightloom, one file per document':<36} {fmb / ft:7.1f} MB/s  ({ft:.1f} s wall, {fcpu:.1f} CPU-s)")
    print(f"{'(h) nightloom, the same as one JSONL':<36} {fmb / jt:7.1f} MB/s  ({jt:.1f} s wall, {jcpu:.1f} CPU-s)")
    print(f"    ratio many files / one JSONL = {jt / ft:.2f}  (target ≥ 0.5)")


FILES_LINE: list[str] = []


def _run_child_once(kind: str, *args: str) -> tuple[float, int, str, float]:
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
    cpu = float(next(ln.split()[1] for ln in p.stderr.splitlines() if ln.startswith("CPU_S")))
    extra = next((ln for ln in p.stderr.splitlines() if ln.startswith("IMBALANCE")), "")
    FILES_LINE.extend(
        ln for ln in p.stderr.splitlines() if ln.startswith("FILES") and kind == "files" and "text" in args
    )
    return wall, rss, extra, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024, help="corpus size (default 1 GiB)")
    ap.add_argument("--small-mb", type=float, default=None, help="second size for the RSS check (default size/4)")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--workers", type=int, default=0, help="nightloom threads (default 0: the library's, 1/CPU)")
    ap.add_argument("--compression", default="zstd", choices=["zstd", "snappy", "lz4", "none"])
    ap.add_argument("--repeat", type=int, default=2, help="runs per route; the best is reported (default 2)")
    ap.add_argument("--skip-datasets", action="store_true")
    ap.add_argument("--skip-duckdb", action="store_true", help="leave out the DuckDB route (dev extra: duckdb)")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp dir, removed after)")
    ap.add_argument(
        "--many-files",
        type=int,
        default=0,
        help="also shard N documents as N small text files against the same documents as one JSONL (0: skip)",
    )
    ap.add_argument(
        "--code-corpus",
        default=None,
        metavar="DIR",
        help="only the many-small-files route on a real code corpus: every *.py under DIR, one file per document, "
        "against the same documents as one JSONL (e.g. a venv's site-packages)",
    )
    ap.add_argument("--tokens-mb", type=float, default=0, help="also the real-tokenizer route on N MB (0: skip)")
    ap.add_argument("--tokens-only", action="store_true", help="only the real-tokenizer route (default 64 MB)")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer folder for it (default: train a 32k BPE)")
    ap.add_argument(
        "--s3-readahead",
        type=float,
        default=0,
        metavar="MS",
        help="only the S3 writers' read-ahead route, MS added to every GET (needs S3_ENDPOINT_URL)",
    )
    a = ap.parse_args()
    global REPEAT
    REPEAT = max(1, a.repeat)
    small_mb = a.small_mb or a.size_mb / 4
    scratch = Path(a.dir or tempfile.mkdtemp(prefix="nl-bench-"))
    scratch.mkdir(parents=True, exist_ok=True)
    cores = a.workers or os.cpu_count() or 1
    if a.code_corpus:
        try:
            folder, same = scratch / "code", scratch / "code.jsonl"
            t = time.perf_counter()
            n, nbytes = copy_code(Path(a.code_corpus), folder, same)
            print(f"code corpus: {n} *.py files copied from {a.code_corpus} in {time.perf_counter() - t:.1f} s")
            many_files_route(f"code corpus: {n} files", folder, same, nbytes, scratch)
        finally:
            if a.dir is None:
                shutil.rmtree(scratch, ignore_errors=True)
        return 0
    if a.s3_readahead:
        try:
            s3_readahead_route(scratch, a.s3_readahead)
        finally:
            if a.dir is None:
                shutil.rmtree(scratch, ignore_errors=True)
        return 0
    if a.tokens_only:
        try:
            token_bench(scratch, a.tokens_mb or 64, a.tokenizer, cores)
        finally:
            if a.dir is None:
                shutil.rmtree(scratch, ignore_errors=True)
        return 0
    try:
        big, small = scratch / "big.jsonl", scratch / "small.jsonl"
        t = time.perf_counter()
        nbig = make_corpus(big, a.size_mb, seed=1)
        nsmall = make_corpus(small, small_mb, seed=2)
        print(
            f"corpus: {nbig / 2**20:.0f} MiB and {nsmall / 2**20:.0f} MiB generated in {time.perf_counter() - t:.1f} s"
        )
        mb = nbig / 2**20
        nl_args = (str(a.shards), str(a.workers), a.compression)
        raw_t, raw_rss, _, raw_cpu = run_child("raw", str(big))
        floor_out, out, out_s, hf = scratch / "floor.parquet", scratch / "out", scratch / "out-s", scratch / "hf"
        fl_t, fl_rss, _, fl_cpu = run_child("floor", str(big), str(floor_out), a.compression, out=floor_out)
        nl_t, nl_rss, info, nl_cpu = run_child("nightloom", str(big), str(out), *nl_args, out=out)
        _, nl_small_rss, _, _ = run_child("nightloom", str(small), str(out_s), *nl_args, out=out_s)
        print(f"nightloom: {info}  (imbalance plain → final, duplicates dropped, rows); codec {a.compression}")

        table: list[tuple[str, float, float, int]] = []

        def line(label: str, t: float, cpu: float, rss: int | None = None) -> None:
            mem = f", peak RSS {rss / 1024:.0f} MiB" if rss else ""
            print(f"{label:<36} {mb / t:7.1f} MB/s  ({t:.1f} s wall, {cpu:.1f} CPU-s{mem})")
            table.append((label, mb / t, cpu, rss or 0))

        line("(a) raw read+parse (orjson, 1 core)", raw_t, raw_cpu, raw_rss)
        line("(b) nightloom shard", nl_t, nl_cpu, nl_rss)
        line("(f) floor: Arrow parse + Parquet write", fl_t, fl_cpu, fl_rss)
        print(f"    ratio nightloom / raw read+parse = {raw_t / nl_t:.2f}  (target ≥ 0.7)")
        print(f"    ratio nightloom / floor          = {fl_t / nl_t:.2f}  (what hashing, dedup, balance, spill cost)")
        if not a.skip_duckdb:
            dk = scratch / "duckdb"
            dk_t, dk_rss, _, dk_cpu = run_child("duckdb", str(big), str(dk), *nl_args, out=dk)
            line("(d) DuckDB distinct+hash%N+Parquet", dk_t, dk_cpu, dk_rss)
            print(f"    ratio nightloom / DuckDB = {dk_t / nl_t:.2f}  (target ≥ 1)")
        if not a.skip_datasets:
            ds_t, ds_rss, _, ds_cpu = run_child("datasets", str(big), str(hf), str(a.shards), out=hf)
            line("(c) datasets load+shard+to_parquet", ds_t, ds_cpu, ds_rss)
            print(f"    ratio nightloom / datasets = {ds_t / nl_t:.2f}  (target > 1)")
        if a.many_files:
            folder, same = scratch / "files", scratch / "same.jsonl"
            nbytes = explode(big, folder, a.many_files, same)
            many_files_route(f"many files: {a.many_files} text files", folder, same, nbytes, scratch)
            pairs_route(folder, scratch)
        print(
            f"peak RSS nightloom: {nsmall / 2**20:.0f} MiB corpus → {nl_small_rss / 1024:.0f} MiB; "
            f"{mb:.0f} MiB corpus → {nl_rss / 1024:.0f} MiB  (ratio {nl_rss / nl_small_rss:.2f} for "
            f"{nbig / nsmall:.1f}× the data)"
        )
        print(f"\n| route ({mb:.0f} MiB, {a.shards} shards, {a.compression}) | MB/s | CPU s | peak RSS |")
        print("|---|---|---|---|")
        for label, speed, cpu, rss in table:
            print(f"| {label} | {speed:.0f} | {cpu:.1f} | {rss / 1024:.0f} MiB |")
        if a.tokens_mb:
            token_bench(scratch, a.tokens_mb, a.tokenizer, cores)
        plateau = a.shards * 16  # MiB: below this each shard is less than one 16 MiB row group (smaller buffers)
        if nsmall / 2**20 < plateau:
            print(
                f"    note: under {plateau} MiB of corpus ({a.shards} shards) each shard is smaller than one row "
                "group, so the writers' buffers are too; memory plateaus above it (compare two sizes above it)"
            )
    finally:
        if a.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
