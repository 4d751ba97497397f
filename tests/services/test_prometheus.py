"""A real Prometheus scrapes the trainer's per-rank exporter; values read back through the HTTP API match the JSONL.

Prometheus: PROMETHEUS_URL + PROMETHEUS_SD_FILE (a file_sd target file it watches; `.ci/services.sh env`
exports both), or, when PROMETHEUS_URL is unset, a `prometheus` binary started here on 127.0.0.1 with a
temp config. Without the binary the tests skip (CI=true: fail).
Two feeds: (1) the trainer's exporter (nightloom.train.prom.RankMetrics) driven step by step from a metrics
JSONL, plus every Grafana dashboard query evaluated on the real server; (2) a short real 2-rank training run.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from nightloom.metrics import PROMETHEUS_METRICS, StepMetrics, append_metrics, read_metrics
from tests.support.ci import require_binary

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deployments" / "grafana" / "dashboard.json"
#: Prometheus metric → StepMetrics field it must equal (memory is rank-local there, a max over ranks here)
FIELDS = {
    "nightloom_step": "step",
    "nightloom_loss": "loss",
    "nightloom_grad_norm": "grad_norm",
    "nightloom_tokens_per_second": "tokens_per_s",
    "nightloom_step_time_seconds": "step_time_s",
    "nightloom_mfu": "mfu",
    "nightloom_collective_latency_seconds": "collective_latency_s",
}
#: the globally reduced figures every rank exports identically; throughput, step time, MFU and latency are
#: measured by each rank on its own clock, so only rank 0's equal the JSONL (which rank 0 writes)
GLOBAL = ("nightloom_step", "nightloom_loss", "nightloom_grad_norm")


def free_port(consecutive: int = 1) -> int:
    """A port p with p..p+consecutive-1 free on 127.0.0.1 (the trainer uses metrics_port + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + consecutive > 65535:
            continue
        try:
            for p in range(base, base + consecutive):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free consecutive ports")


class Prom:
    """A Prometheus HTTP API client plus the targets this module asked it to scrape."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def get(self, path: str, **params) -> dict:
        q = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        return self.get("/api/v1/query", query=expr, **({"time": at} if at else {}))["result"]

    def wait(self, what: str, cond, timeout: float = 30.0, every: float = 0.1):
        t0 = time.monotonic()
        while True:
            try:
                got = cond()
            except OSError:
                got = None
            if got:
                return got
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"Prometheus at {self.url}: timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(every)

    def samples(self, run: str) -> dict[str, dict[float, dict[str, float]]]:
        """Raw scraped samples of a run: rank → scrape timestamp → metric → value."""
        out: dict[str, dict[float, dict[str, float]]] = {}
        for series in self.query(f'{{__name__=~"nightloom_.*", run="{run}"}}[1h]'):
            rank, name = series["metric"]["rank"], series["metric"]["__name__"]
            for ts, val in series["values"]:
                out.setdefault(rank, {}).setdefault(float(ts), {})[name] = float(val)
        return out


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    """A Prometheus scraping ports A, A+1 (JSONL feed) and B, B+1 (training run); yields (Prom, A, B)."""
    a, b = free_port(2), free_port(2)
    targets = [f"127.0.0.1:{p}" for p in (a, a + 1, b, b + 1)]
    url, sd_file = os.environ.get("PROMETHEUS_URL"), os.environ.get("PROMETHEUS_SD_FILE")
    proc = None
    tmp = tmp_path_factory.mktemp("prometheus")
    if url:
        if not sd_file:
            pytest.fail("PROMETHEUS_URL is set but PROMETHEUS_SD_FILE (its file_sd target file) is not")
        sd = Path(sd_file)
        groups = json.loads(sd.read_text()) if sd.exists() and sd.read_text().strip() else []
        mine = {"targets": targets, "labels": {"test": "nightloom-prometheus"}}
        _write_json(sd, [*groups, mine])
    else:
        binary = require_binary("prometheus")
        port = free_port()
        cfg = tmp / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 250ms\n  scrape_timeout: 200ms\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: nightloom\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n"
        )
        log = open(tmp / "prometheus.log", "w")  # noqa: SIM115 - closed in the finally below, after the server
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
    p = Prom(url)
    try:
        if proc is not None:
            p.wait("/-/ready", lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200)
        # every target has a scrape loop (up == 0 until its exporter exists); file_sd updates take ~5 s
        want = set(targets)
        p.wait(
            "scrape loops for the test targets",
            lambda: want <= {r["metric"]["instance"] for r in p.query("up")},
            timeout=60,
        )
        yield p, a, b
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            log.close()
        elif sd_file:
            sd = Path(sd_file)
            groups = [g for g in json.loads(sd.read_text()) if g.get("targets") != targets]
            _write_json(sd, groups)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _extra(m: StepMetrics, field: str) -> float | None:
    return getattr(m, field, None) if field in StepMetrics.model_fields else (m.model_extra or {}).get(field)


def _check_against_jsonl(
    samples: dict[float, dict[str, float]],
    by_step: dict[int, StepMetrics],
    where: str,
    names: tuple[str, ...] = tuple(FIELDS),
) -> int:
    """Every scrape shows one JSONL step's values (a scrape may land between two gauge updates of one step,
    so a value may still be the previous step's); returns how many scrapes matched a step exactly."""
    exact = 0
    for ts, row in sorted(samples.items()):
        if "nightloom_step" not in row:
            continue
        step = int(row["nightloom_step"])
        assert step in by_step, f"{where} @ {ts}: step {step} is not in the JSONL"
        cur, prev = by_step[step], by_step.get(step - 1)
        full = True
        for name, field in FIELDS.items():
            if name == "nightloom_step" or name not in row or name not in names:
                continue
            want = _extra(cur, field)
            old = _extra(prev, field) if prev else None
            got = row[name]
            if want is not None and math.isclose(got, want, rel_tol=1e-12, abs_tol=0.0):
                continue
            full = False
            assert old is not None and math.isclose(got, old, rel_tol=1e-12), (
                f"{where} @ {ts}: {name} = {got!r} at step {step}, JSONL has {want!r}"
            )
        exact += full
    return exact


def test_exporter_fed_from_jsonl_and_dashboard_queries(prom, tmp_path: Path):
    from nightloom.train.prom import RankMetrics

    p, port, _ = prom
    run = f"jsonl-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "metrics.jsonl"
    for s in range(1, 5):
        append_metrics(
            path,
            StepMetrics(
                step=s,
                loss=4.0 / s + 0.123456789,
                grad_norm=1.5 / s,
                tokens=4096,
                tokens_per_s=1000.0 + s,
                step_time_s=4.096 / (1 + s / 1000),
                peak_mem_bytes=2**20 * (100 + s),
                mfu=0.1 + s / 100,
                collective_latency_s=1e-4 * s,
            ),
        )
    steps = read_metrics(path)
    ranks = [RankMetrics(port + r, run, r) for r in (0, 1)]
    try:
        for m in steps:
            for rm in ranks:
                rm.update(
                    step=m.step,
                    loss=m.loss,
                    grad_norm=m.grad_norm,
                    tokens_per_s=m.tokens_per_s,
                    step_time_s=m.step_time_s,
                    mfu=m.mfu,
                    memory_bytes=m.peak_mem_bytes,
                    collective_latency_s=m.model_extra["collective_latency_s"],
                )
            p.wait(
                f"step {m.step} scraped from both ranks",
                lambda m=m: len(p.query(f'nightloom_step{{run="{run}"}} == {m.step}')) == 2,
                timeout=30,
            )
        # the dashboard queries below are evaluated at this instant: once the exporters close, the next scrape fails
        # and Prometheus marks the series stale, so an instant query "now" on a loaded box can find nothing
        scraped_at = time.time()
    finally:
        for rm in ranks:
            rm.close()
    got = p.samples(run)
    assert set(got) == {"0", "1"}
    by_step = {m.step: m for m in steps}
    for rank, rows in got.items():
        assert {int(r["nightloom_step"]) for r in rows.values()} == set(by_step)  # every step was scraped
        assert _check_against_jsonl(rows, by_step, f"rank {rank}") >= len(by_step) - 1
        mem = {int(r["nightloom_step"]): r["nightloom_memory_bytes"] for r in rows.values()}
        assert all(mem[s] in (by_step[s].peak_mem_bytes, by_step.get(s - 1, by_step[s]).peak_mem_bytes) for s in mem)
    assert {n for rows in got.values() for r in rows.values() for n in r} == set(PROMETHEUS_METRICS)

    # every dashboard query is valid PromQL on the real server and returns this run's data
    dash = json.loads(DASHBOARD.read_text())
    for panel in dash["panels"]:
        for t in panel["targets"]:
            expr = t["expr"].replace("$run", run).replace("$rank", ".*")
            res = p.query(expr, at=scraped_at)
            assert res, f"dashboard panel {panel['title']!r}: {expr} returned nothing"
    runs = p.get("/api/v1/label/run/values", **{"match[]": "nightloom_step"})
    assert run in runs


@pytest.mark.timeout(300)
def test_real_training_run_is_scraped(prom, tmp_path: Path):
    from tests.support.harness import env, make_job, torchrun_cmd, write_corpus

    p, _, port = prom
    corpus = write_corpus(tmp_path / "corpus", shards=2, docs_per_shard=40)
    run_dir = tmp_path / f"train-{uuid.uuid4().hex[:8]}"
    job = make_job(
        run_dir,
        corpus,
        steps=80,
        seq_len=32,
        global_batch=4,
        timeout_s=60,
        micro_batch=1,
        grad_accum=2,
        dp_shard=2,
        train_kw={"metrics_port": port},
    )
    proc = subprocess.run(
        torchrun_cmd(2, job), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    steps = read_metrics(run_dir / "metrics.jsonl")
    assert len(steps) == 80
    by_step = {m.step: m for m in steps}
    got = p.samples(run_dir.name)
    assert got, f"the 80-step run ({steps[-1].time - steps[0].time:.1f} s of steps) was never scraped"
    assert set(got) == {"0", "1"}, f"ranks scraped: {sorted(got)}"
    for rank, rows in got.items():
        names = tuple(FIELDS) if rank == "0" else GLOBAL
        assert _check_against_jsonl(rows, by_step, f"training rank {rank}", names) >= 1
        mem = [r["nightloom_memory_bytes"] for r in rows.values() if "nightloom_memory_bytes" in r]
        assert mem, f"training rank {rank}: nightloom_memory_bytes was never scraped"
        assert all(m > 0 for m in mem), f"training rank {rank}: nightloom_memory_bytes {min(mem)}"
