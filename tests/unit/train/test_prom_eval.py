"""The trainer's Prometheus endpoint exports the held-out eval loss and perplexity once a run has evaluated."""

from __future__ import annotations

import socket
import urllib.request

from nightloom.metrics import PROMETHEUS_EVAL_METRICS, PROMETHEUS_METRICS
from nightloom.train.prom import EVAL_NAMES, NAMES, RankMetrics


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_eval_gauges_appear_after_an_evaluation():
    assert sorted(EVAL_NAMES.values()) == sorted(PROMETHEUS_EVAL_METRICS)
    assert not set(PROMETHEUS_EVAL_METRICS) & set(PROMETHEUS_METRICS)
    port = _port()
    m = RankMetrics(port, "r1", 0)
    try:
        m.update(step=1, loss=2.0)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'nightloom_loss{rank="0",run="r1"} 2.0' in body
        assert "nightloom_eval_loss{" not in body  # not evaluated yet: no sample
        m.update(step=2, loss=1.5, eval_loss=1.75, eval_ppl=5.75)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'nightloom_eval_loss{rank="0",run="r1"} 1.75' in body
        assert 'nightloom_eval_perplexity{rank="0",run="r1"} 5.75' in body
        assert set(NAMES.values()) == set(PROMETHEUS_METRICS)
    finally:
        m.close()
