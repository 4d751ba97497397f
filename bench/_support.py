"""What the benchmarks need besides nightloom itself: a tiny corpus, a TrainJob file, a real trainer launch, the
demo spec shrunk for a recovery run, and a fault injector. bench/ imports nothing from tests/ (a unit test
checks it), so these are the benchmarks' own, sized for them."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the night loom weaves long threads of data into models while the cluster sleeps and the gradients flow "
    "across ranks in quiet pipelines of tensors sharded by hash"
).split()


def write_corpus(folder: Path, shards: int = 4, docs_per_shard: int = 60, seed: int = 0, salt: str = "bench") -> Path:
    """Parquet shards (column `text`, random words) and their manifest.json (ShardManifest); the folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nightloom.sharding.manifest import ShardInfo, ShardManifest

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    infos = []
    for i in range(shards):
        docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(docs_per_shard)]
        name = f"shard-{i:05d}.parquet"
        pq.write_table(pa.table({"text": docs}), folder / name)
        data = (folder / name).read_bytes()
        tokens = sum(len(d.encode("utf-8")) for d in docs)  # byte tokenizer: one token per byte
        infos.append(
            ShardInfo(
                index=i,
                path=name,
                rows=len(docs),
                tokens=tokens,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )
    manifest = ShardManifest(
        num_shards=shards,
        key="<text>",
        salt=salt,
        imbalance=0.0,
        imbalance_before_rebalance=0.0,
        balanced=True,
        rows=sum(s.rows for s in infos),
        tokens=sum(s.tokens for s in infos),
        bytes=sum(s.bytes for s in infos),
        shards=infos,
    )
    (folder / "manifest.json").write_text(manifest.to_json(), encoding="utf-8")
    return folder


def make_job(
    run_dir: Path,
    manifest: Path,
    *,
    model: str,
    steps: int,
    seq_len: int,
    global_batch: int,
    timeout_s: int,
    peak_flops: float,
    peak_source: str,
    shape=None,
    train_extra: dict | None = None,
    **plan,
) -> Path:
    """Write `<run_dir>/job.json` (a TrainJob; `plan` holds ParallelPlan fields) and return its path. `shape` (a
    ModelShape) instead of the catalog's `model`; `train_extra`: more TrainSpec fields (e.g. lora)."""
    from nightloom.catalog import get_model
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import TrainSpec
    from nightloom.train.job import TrainJob

    run_dir.mkdir(parents=True, exist_ok=True)
    train = TrainSpec(
        steps=steps,
        seq_len=seq_len,
        global_batch=global_batch,
        lr=3e-3,
        warmup_steps=2,
        collective_timeout_s=timeout_s,
        seed=1234,
        **(train_extra or {}),
    )
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=shape if shape is not None else get_model(model),
        plan=ParallelPlan(**plan),
        train=train,
        manifest=str(manifest),
        peak_flops=peak_flops,
        peak_source=peak_source,
    )
    path = run_dir / "job.json"
    path.write_text(job.model_dump_json(indent=2), encoding="utf-8")
    return path


@dataclass
class TrainerRun:
    rc: int
    output: str
    metrics: list


def trainer_cmd(nproc: int, job: Path) -> list[str]:
    """The trainer's command line: one process, or torchrun --standalone for nproc > 1."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.2"]
    return [sys.executable, *(torchrun if nproc > 1 else []), "-m", "nightloom.train", "--job", str(job)]


def trainer_env() -> dict[str, str]:
    """One thread per rank, this checkout importable, no GPU."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def launch(nproc: int, job: Path, timeout: float) -> TrainerRun:
    """Run the trainer for real; its metrics read back."""
    from nightloom.metrics import read_metrics

    p = subprocess.run(
        trainer_cmd(nproc, job),
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"trainer exited {p.returncode}:\n{out[-6000:]}")
    mpath = job.parent / "metrics.jsonl"
    return TrainerRun(p.returncode, out, read_metrics(mpath) if mpath.exists() else [])


def recovery_spec(tmp: Path, nodes: int, ranks: int, steps: int, **recovery) -> Path:
    """The embedded demo spec with its outputs in `tmp`, a short run on `nodes` × `ranks` local ranks, and the
    given `recovery:` settings; written to tmp/spec.yaml."""
    data = yaml.safe_load((ROOT / "deployments" / "local-demo.yaml").read_text())
    data["dataset"]["path"] = str(ROOT / "datasets" / "sample" / "corpus.jsonl")
    data["sharding"]["output"] = str(tmp / "shards")
    data["model"]["tokenizer"]["path"] = str(tmp / "tokenizer")  # the demo's BPE, trained on first use
    data["storage"]["root"] = str(tmp / "runs")
    data["ledger"]["url"] = f"sqlite:///{tmp / 'ledger.db'}"
    data["train"].update({"steps": steps, "checkpoint_every": 4, "seq_len": 64, "collective_timeout_s": 20})
    data["cluster"].update(
        {"nodes": nodes, "gpus_per_node": ranks, "name": f"bench-{tmp.name}", "master_port": 20000 + os.getpid() % 5000}
    )
    data["recovery"] = {"max_attempts": 2, "max_minutes": 10, "allow_relayout": True, **recovery}
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Chaos(threading.Thread):
    """Faults (attempt, first step, rank, sicken): once the run's metrics show `attempt` at or past that step,
    call `sicken` (if given: make a node fail preflight from now on) and kill that rank's process group."""

    def __init__(self, runs_root: Path, faults: list[tuple[int, int, int, Callable[[], None] | None]]):
        super().__init__(daemon=True)
        self.root, self.faults = runs_root, list(faults)
        self.done: list[tuple[int, int, int]] = []  # (attempt, step seen, rank) of each fault injected
        self.stop = threading.Event()

    def _metrics(self) -> tuple[Path | None, list[dict]]:
        for m in self.root.glob("*/metrics.jsonl"):
            return m.parent, [json.loads(x) for x in m.read_text().splitlines() if x.strip().endswith("}")]
        return None, []

    def run(self) -> None:
        while self.faults and not self.stop.is_set():
            run_dir, lines = self._metrics()
            attempt, min_step, rank, sicken = self.faults[0]
            hit = [x for x in lines if x.get("attempt", 0) == attempt and x["step"] >= min_step]
            if run_dir is not None and hit:
                if sicken is not None:
                    sicken()
                pid = int((run_dir / "pids" / f"rank-{rank}.pid").read_text())
                try:
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.done.append((attempt, hit[0]["step"], rank))
                self.faults.pop(0)
            time.sleep(0.05)


def run_under_chaos(spec_path: Path, runs_root: Path, faults) -> tuple[Chaos, object]:
    """Run the pipeline flow on `spec_path` while a Chaos thread injects `faults`; (chaos, the flow's state)."""
    from flows.pipeline import training_pipeline

    chaos = Chaos(runs_root, faults)
    chaos.start()
    try:
        state = training_pipeline(str(spec_path), return_state=True)
    finally:
        chaos.stop.set()
    return chaos, state


def mark_unhealthy(folder: Path, node: str) -> None:
    """Make `node` of the local provider fail preflight (the marker file nightloom.provision.local reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / node).write_text("injected on purpose (a benchmark or a test)\n")
