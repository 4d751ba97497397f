"""The Grafana dashboard is valid dashboard JSON and queries only the metrics and labels the trainer exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nightloom.metrics import PROMETHEUS_LABELS, PROMETHEUS_METRICS

DASHBOARD = Path(__file__).resolve().parents[3] / "deployments" / "grafana" / "dashboard.json"
GRAFANA_VARS = {"run", "rank", "datasource"}


def load() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def queries(d: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = []
    for p in d["panels"]:
        for t in p["targets"]:
            out.append((f"panel {p['title']!r} target {t['refId']}", t["expr"]))
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", v["query"]["query"]))
    return out


def test_dashboard_is_valid_grafana_json():
    d = load()
    for key, typ in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list), ("templating", dict)):
        assert isinstance(d.get(key), typ), f"{key} missing or not {typ.__name__}"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in d["panels"]:
        assert p["type"] in {"timeseries", "stat"} and p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["datasource"]["type"] == "prometheus"
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
    # datasource references resolve to a defined variable
    names = {v["name"] for v in d["templating"]["list"]}
    used = set(re.findall(r"\$\{?(\w+)", json.dumps(d)))
    assert used <= names, f"undefined dashboard variables: {used - names}"


@pytest.mark.parametrize("where,expr", queries(load()))
def test_every_query_names_an_exported_metric_and_label(where, expr):
    metrics = set(re.findall(r"\bnightloom_\w+", expr))
    assert metrics, f"{where}: names no nightloom metric: {expr}"
    assert metrics <= set(PROMETHEUS_METRICS), (
        f"{where}: not exported by the trainer: {metrics - set(PROMETHEUS_METRICS)}"
    )
    labels = set()
    for sel in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel))
    for grp in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in grp.split(",") if x.strip()}
    labels |= set(re.findall(r"label_values\([^,]*,\s*(\w+)\)", expr))
    assert labels <= set(PROMETHEUS_LABELS), f"{where}: unknown labels {labels - set(PROMETHEUS_LABELS)}"


def test_every_exported_metric_is_on_the_dashboard():
    shown = {m for _, e in queries(load()) for m in re.findall(r"\bnightloom_\w+", e)}
    assert shown == set(PROMETHEUS_METRICS)
