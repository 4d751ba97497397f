"""Failure handling: a killed rank ends the job non-zero well within the collective timeout; invalid layouts
fail with clear errors before any process group starts. Also scrapes the per-rank Prometheus endpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import pytest

from nightloom.catalog import get_model
from nightloom.metrics import PROMETHEUS_METRICS
from nightloom.parallel import LayoutError, ParallelPlan
from nightloom.train.parallelize import validate_plan
from nightloom.train.prom import NAMES
from tests.support.harness import ROOT, env, free_port, make_job, torchrun_cmd

TIMEOUT_S = 60


def _wait_for(pred, limit: float, what: str):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {limit} s waiting for {what}")


@pytest.mark.timeout(240)
def test_killed_rank_fails_the_job_fast_and_prometheus_serves_every_rank(corpus, tmp_path):
    port = free_port()
    run = tmp_path / "kill"
    job = make_job(
        run,
        corpus,
        steps=100_000,
        timeout_s=TIMEOUT_S,
        train_kw={"metrics_port": port},
        dp_shard=2,
        micro_batch=2,
        grad_accum=2,
    )
    with open(tmp_path / "log.txt", "w+") as log:
        proc = subprocess.Popen(
            torchrun_cmd(2, job), cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            metrics = run / "metrics.jsonl"
            _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 150, "two steps")
            for rank in (0, 1):  # each rank serves its own endpoint, with the dashboard's names and labels
                body = urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics", timeout=5).read().decode()
                for name in PROMETHEUS_METRICS:
                    assert f'{name}{{rank="{rank}",run="kill"}}' in body, (name, body[-2000:])
            victim = int((run / "pids" / "rank-1.pid").read_text())
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            rc = proc.wait(timeout=TIMEOUT_S)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        out = log.read()
    print(f"job exited {rc} {took:.1f} s after rank 1 was killed (collective timeout {TIMEOUT_S} s)")
    assert rc != 0
    assert took < TIMEOUT_S / 2, out[-3000:]
    assert "SIGKILL" in out or "Signal 9" in out, out[-3000:]  # the cause is in the log
    assert not (run / "result.json").exists()


def test_prometheus_names_are_the_dashboard_contract():
    assert sorted(NAMES.values()) == sorted(PROMETHEUS_METRICS)


@pytest.mark.parametrize(
    "plan,world,message",
    [
        ({"tp": 2, "dp_shard": 2}, 2, "= 4 processes, but WORLD_SIZE=2"),
        ({"tp": 8}, 8, "heads (4) and kv_heads (2) must be divisible by tp (8)"),
        ({"pp": 3, "grad_accum": 3}, 3, "layers (4) must be divisible by pp*virtual_stages (3*1)"),
        (
            {"pp": 2, "virtual_stages": 4, "schedule": "interleaved_1f1b", "grad_accum": 2},
            2,
            "divisible by pp*virtual_stages",
        ),
        ({"pp": 2, "virtual_stages": 2, "schedule": "1f1b", "grad_accum": 2}, 2, "needs schedule 'interleaved_1f1b'"),
        ({"pp": 2, "grad_accum": 1}, 2, "grad_accum (= microbatches, 1) >= pp (2)"),
        ({"cp": 2}, 2, "context parallel (cp=2) runs on CUDA only"),
        ({"dp_shard": 2, "micro_batch": 3}, 2, "train.global_batch (8) != micro_batch(3) * grad_accum(1) * dp(2) = 6"),
    ],
)
def test_invalid_layouts_are_rejected_with_the_values(plan, world, message):
    p = ParallelPlan(**{"micro_batch": 8 // plan.get("dp_shard", 1), **plan})
    with pytest.raises(LayoutError) as e:
        validate_plan(get_model("tiny"), p, seq_len=32, global_batch=8, world_size=world, device_type="cpu")
    assert message in str(e.value)


@pytest.mark.timeout(120)
def test_invalid_layout_exits_2_before_any_process_group(corpus, tmp_path):
    """A rank of a 2-process job with tp=8: the error comes before init_process_group (whose rendezvous
    at an address nobody serves would otherwise hang until the timeout)."""
    job = make_job(tmp_path / "bad", corpus, timeout_s=TIMEOUT_S, tp=8, micro_batch=8)
    e = dict(env(), WORLD_SIZE="8", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run(torchrun_cmd(1, job), cwd=ROOT, env=e, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "invalid layout: heads (4) and kv_heads (2) must be divisible by tp (8)" in p.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
