"""Run the benchmarks of one run: the lm-eval process in the task folder with no network, on the export and (once
per base, settings and task folder) on the base, whose scores are cached so the next night does not pay again."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import xxhash

from nightloom.benchmarks.harness import OFFLINE
from nightloom.benchmarks.records import SPEC_SETTINGS, BenchJob, BenchResult, ModelScores
from nightloom.provision.base import Cluster, Node, NodeShell
from nightloom.spec.benchmarks import BenchmarksSpec
from nightloom.util import atomic_write_text

LOG = "benchmarks.log"


class BenchmarkError(RuntimeError):
    """The lm-eval process failed; the message holds the end of its log and the log's path."""


#: files above this are keyed by name, size and mtime, not read: a 70B base is 140 GB to hash every night
WHOLE_BYTES = 64 << 20


def folder_digest(folder: str | Path) -> str:
    """xxh3-128 over every file's relative name and bytes, in name order (a task folder, a model's configs); a file
    over WHOLE_BYTES (weights) by its size and modification time instead of its bytes."""
    h = xxhash.xxh3_128()
    root = Path(folder)
    for p in sorted(q for q in root.rglob("*") if q.is_file() and "__pycache__" not in q.parts):
        st = p.stat()
        h.update(str(p.relative_to(root)).encode() + b"\0")
        if st.st_size > WHOLE_BYTES:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
            continue
        with p.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def tokenizer_digest(folder: str | Path) -> str:
    """xxh3-128 over a Hugging Face folder's tokenizer files only (the export's weights change every run)."""
    h = xxhash.xxh3_128()
    for p in sorted(Path(folder).iterdir()):
        tok = p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "added_tokens"))
        if p.is_file() and (tok or p.suffix == ".model"):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def base_key(base_dir: str, job: BenchJob) -> str:
    """The base's cache key: its weights, the tokenizer it is read with, the task folder, lm-eval's version and
    every setting that changes a score or a completion."""
    parts = [folder_digest(base_dir), tokenizer_digest(job.tokenizer) if job.tokenizer else "", version("lm_eval")]
    parts.append(folder_digest(job.include_path) if job.include_path else "")
    parts.append(json.dumps(job.model_dump(exclude={"models", "output", "tokenizer", "include_path"}), sort_keys=True))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def make_job(settings: BenchmarksSpec, tokenizer: str | None, prompts: list[str], output: Path) -> BenchJob:
    """The lm-eval process's job (its models set per call)."""
    return BenchJob(
        models=[],
        tokenizer=tokenizer,
        prompts=prompts[: settings.completions],
        output=str(Path(output).resolve()),
        **settings.model_dump(include=set(SPEC_SETTINGS)),
    )


#: runs `python <module args>` with extra environment somewhere (this machine, a rented node): (exit code, output)
Runner = Callable[[list[str], dict[str, str]], tuple[int, str]]
ENV = OFFLINE | {"TOKENIZERS_PARALLELISM": "false"}


def local_runner(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """This machine's interpreter, the orchestrator's environment plus `env`."""
    r = subprocess.run([sys.executable, *args], env=os.environ | env, capture_output=True, text=True, check=False)
    return r.returncode, r.stdout + r.stderr


def node_runner(shell: NodeShell, cluster: Cluster, node: Node, timeout_s: float = 6 * 3600.0) -> Runner:
    """A rented node's interpreter through its provider's shell (ssh, slurm): the run's own nodes and GPUs; the
    job and result files are in the run folder, which every node shares."""

    def run(args: list[str], env: dict[str, str]) -> tuple[int, str]:
        r = shell.run_on(cluster, node, [node.python, *args], env, timeout_s=timeout_s)
        return r.code, f"[{r.node}] {r.output}"

    return run


def run_process(job: BenchJob, work_dir: Path, runner: Runner | None = None) -> list[ModelScores]:
    """One `python -m nightloom.benchmarks` over the job's models (it works in the task folder), offline, on this
    machine or through `runner`; its output goes to work_dir/benchmarks.log (appended)."""
    path = work_dir / f"bench-job-{os.getpid()}.json"
    atomic_write_text(path, job.model_dump_json(indent=1))
    rc, output = (runner or local_runner)(["-m", "nightloom.benchmarks", "--job", str(path)], dict(ENV))
    with (work_dir / LOG).open("a", encoding="utf-8") as log:
        log.write(output)
    if rc != 0:
        tail = (work_dir / LOG).read_text(errors="replace")[-3000:]
        raise BenchmarkError(f"lm-eval exited with {rc} (log: {work_dir / LOG}):\n{tail}")
    out = [ModelScores.model_validate(r) for r in json.loads(Path(job.output).read_text())]
    path.unlink(missing_ok=True)
    return out


def run_benchmarks(
    settings: BenchmarksSpec,
    export_dir: str,
    base_dir: str | None,
    work_dir: Path,
    cache_dir: Path,
    prompts: list[str],
    runner: Runner | None = None,
) -> BenchResult:
    """Score the export and, when asked and not cached, the base in one lm-eval process; the base's scores are
    kept in cache_dir/base-KEY.json."""
    t0 = time.perf_counter()
    work_dir, cache_dir = Path(work_dir).resolve(), Path(cache_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    export_dir, base_dir = str(Path(export_dir).resolve()), str(Path(base_dir).resolve()) if base_dir else None
    if settings.include_path:  # the process runs in the task folder: every path absolute
        settings = settings.model_copy(update={"include_path": str(Path(settings.include_path).resolve())})
    job = make_job(settings, export_dir, prompts, work_dir / "benchmarks.raw.json")
    cached, key = None, None
    if settings.base and base_dir:
        key = base_key(base_dir, job)
        hit = cache_dir / f"base-{key}.json"
        if hit.is_file():
            cached = ModelScores.model_validate_json(hit.read_text()).model_copy(update={"cached": True})
    job.models = [export_dir] + ([base_dir] if settings.base and base_dir and cached is None else [])
    got = run_process(job, work_dir, runner)
    tuned, base = got[0], cached or (got[1] if len(got) > 1 else None)
    if base is not None and cached is None and key is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache_dir / f"base-{key}.json", base.model_dump_json(indent=1))
    return BenchResult(tuned=tuned, base=base, seconds=time.perf_counter() - t0)
