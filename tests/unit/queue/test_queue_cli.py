"""`nightloom queue create|add|list|remove|plan` on a ledger in a temporary folder, at an injected time: the issue's
three jobs in a 4-node queue, an 8-node job and a spec with a bad field refused with the queue unchanged, a removed
job gone from the plan, the hours from --hours, the ledger or the planner."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from nightloom.ledger import Ledger
from nightloom.spec.load import load_spec

AT = "2026-06-01T00:00:00+08:00"
PRICE, DISCOUNT = 2.5, 0.18


def write_spec(tmp_path: Path, name: str, nodes: int, policy: str, **extra) -> str:
    spec = {
        "name": name,
        "model": {"name": "llama2-7b"},
        "dataset": {"path": "data", "sample": True},
        "cluster": {"provider": "slurm", "nodes": nodes, "gpus_per_node": 8, "gpu_type": "h100-80gb"},
        "train": {"steps": 100, "seq_len": 4096, "global_batch": 64},
        "schedule": {
            "timezone": "Asia/Shanghai",
            "policy": policy,
            "price_per_gpu_hour": PRICE,
            "offpeak_discount": DISCOUNT,
            "provisioning_minutes": 10,
        },
    }
    for key, value in extra.items():  # "train.stepz" = 3 puts a key where the schema has none
        section, field = key.split(".")
        spec[section][field] = value
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(spec))
    return str(p)


def q(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["queue", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def team(tmp_path: Path, capsys) -> tuple[str, dict[str, int]]:
    """The issue's queue: 4 nodes; 4 nodes × 3 h at priority 1, 2 × 6 h split, 2 × 2 h wait with a deadline."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    assert q(capsys, "create", "team", "--max-nodes", "4", "--ledger", url)[0] == 0
    ids = {}
    for name, nodes, policy, hours, extra in (
        ("big", 4, "wait", "3", ["--priority", "1"]),
        ("long", 2, "split", "6", ["--priority", "2"]),
        ("short", 2, "wait", "2", ["--priority", "2", "--deadline", "2026-06-02T06:00:00+08:00"]),
    ):
        spec = write_spec(tmp_path, name, nodes, policy)
        rc, out, err = q(capsys, "add", "team", spec, "--hours", hours, *extra, "--ledger", url)
        assert rc == 0, err
        ids[name] = int(out.split("job ")[1].split()[0])
    return url, ids


def plan_json(capsys, url: str, *more) -> dict:
    rc, out, err = q(capsys, "plan", "team", "--at", AT, "--json", "--ledger", url, *more)
    assert rc == 0, err
    return json.loads(out)


def test_the_issue_scenario_end_to_end(team, tmp_path: Path, capsys):
    url, ids = team
    gantt = tmp_path / "plots" / "team.png"
    out = plan_json(capsys, url, "--gantt", str(gantt))
    assert gantt.read_bytes()[:4] == b"\x89PNG"
    assert plan_json(capsys, url) == out  # the same answer twice
    jobs = {j["name"]: j for j in out["jobs"]}
    assert [j["name"] for j in out["jobs"]] == ["big", "short", "long"]
    assert {n: (j["nodes"], j["hours"], j["priority"]) for n, j in jobs.items()} == {
        "big": (4, 3.0, 1),
        "long": (2, 6.0, 2),
        "short": (2, 2.0, 2),
    }
    starts = {n: min(s["start"] for s in j["segments"]) for n, j in jobs.items()}
    assert starts["big"] == "2026-06-01T02:00:00+08:00" == min(starts.values())
    assert jobs["short"]["meets_deadline"] is True and jobs["short"]["finish"] <= jobs["short"]["deadline"]
    assert sum(s["what"] == "provisioning" for s in jobs["short"]["segments"]) == 1  # the wait job: one stretch
    assert sum(s["what"] == "provisioning" for s in jobs["long"]["segments"]) >= 2  # the split job: nights
    events = []
    for j in out["jobs"]:
        for s in j["segments"]:
            start, end = datetime.fromisoformat(s["start"]), datetime.fromisoformat(s["end"])
            assert "02:00" <= start.strftime("%H:%M") and end.strftime("%H:%M:%S") <= "06:00:00"  # in the window
            gpus = 8 * len(s["nodes"])
            assert s["cost"] == pytest.approx((end - start).total_seconds() / 3600 * gpus * PRICE * (1 - DISCOUNT))
            events += [(start, len(s["nodes"])), (end, -len(s["nodes"]))]
        train = sum(
            (datetime.fromisoformat(s["end"]) - datetime.fromisoformat(s["start"])).total_seconds()
            for s in j["segments"]
            if s["what"] == "training"
        )
        assert train / 3600 == pytest.approx(j["hours"])
    held = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # releases before takes at the same instant
        held += delta
        assert held <= 4
    assert sum(n["cost"] for n in out["nights"]) == pytest.approx(sum(j["cost"] for j in out["jobs"]))
    rc, text, _ = q(capsys, "plan", "team", "--at", AT, "--ledger", url)
    assert rc == 0 and "big" in text and "total:" in text


def test_refused_jobs_leave_the_queue_unchanged(team, tmp_path: Path, capsys):
    url, _ = team
    listed = q(capsys, "list", "team", "--json", "--ledger", url)[1]
    planned = plan_json(capsys, url)
    rc, _, err = q(capsys, "add", "team", write_spec(tmp_path, "huge", 8, "wait"), "--hours", "1", "--ledger", url)
    assert rc == 1 and "refuses huge: cluster.nodes: the job needs 8 nodes; the queue has 4" in err
    bad = write_spec(tmp_path, "typo", 2, "wait", **{"train.stepz": 3})
    rc, _, err = q(capsys, "add", "team", bad, "--hours", "1", "--ledger", url)
    assert rc == 1 and "typo.yaml:" in err and "train.stepz: unknown key (typo?)" in err and "unchanged" in err
    berlin = write_spec(tmp_path, "berlin", 2, "wait")
    Path(berlin).write_text(Path(berlin).read_text().replace("Asia/Shanghai", "Europe/Berlin"))
    rc, _, err = q(capsys, "add", "team", berlin, "--hours", "1", "--ledger", url)
    assert rc == 1 and "schedule.timezone: 'Europe/Berlin' contradicts the queue's 'Asia/Shanghai'" in err
    rc, _, err = q(capsys, "add", "team", berlin, "--hours", "1", "--deadline", "2026-06-02T06:00", "--ledger", url)
    assert rc == 2 and "--deadline needs a time zone offset" in err
    assert q(capsys, "list", "team", "--json", "--ledger", url)[1] == listed
    assert plan_json(capsys, url) == planned


def test_a_removed_job_leaves_the_plan(team, capsys):
    url, ids = team
    rc, out, _ = q(capsys, "remove", "team", str(ids["big"]), "--ledger", url)
    assert rc == 0 and f"removed job {ids['big']} big" in out
    out = plan_json(capsys, url)
    assert [j["name"] for j in out["jobs"]] == ["short", "long"]
    assert min(s["start"] for j in out["jobs"] for s in j["segments"]) == "2026-06-01T02:00:00+08:00"
    rc, _, err = q(capsys, "remove", "team", str(ids["big"]), "--ledger", url)
    assert rc == 1 and f"no job {ids['big']} in queue 'team'" in err
    listed = json.loads(q(capsys, "list", "team", "--json", "--ledger", url)[1])
    assert [j["name"] for j in listed["jobs"]] == ["long", "short"] and listed["queue"]["max_nodes"] == 4


def test_hours_from_the_ledger_then_the_planner(tmp_path: Path, capsys, monkeypatch):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("NIGHTLOOM_LEDGER_URL", url)  # the default ledger when --ledger is not given
    assert q(capsys, "create", "team", "--max-nodes", "2")[0] == 0
    spec_path = write_spec(tmp_path, "measured", 2, "split")
    rc, out, err = q(capsys, "add", "team", spec_path)
    assert rc == 0, err
    assert "planner: " in out  # no measurement yet: the planner's step time
    spec = load_spec(spec_path)
    with Ledger(url) as lg:  # a measured run of the same spec on the same cluster and size
        lg.start_run(
            run_id="r1",
            spec_hash=spec.spec_hash(),
            name=spec.name,
            model="llama2-7b",
            cluster=spec.cluster.name,
            provider="slurm",
            gpu_type="h100-80gb",
            world_size=16,
            started_at=datetime(2026, 5, 1, tzinfo=UTC),
        )
        lg.finish_run("r1", status="succeeded", tokens_per_s=64 * 4096 / 36.0)  # 36 s a step: 1 h for 100
    rc, out, err = q(capsys, "add", "team", spec_path)
    assert rc == 0 and "1.00 h (ledger: 36.000 s/step measured by run r1)" in out
    listed = json.loads(q(capsys, "list", "team", "--json")[1])
    assert [j["hours_source"].split(":")[0] for j in listed["jobs"]] == ["planner", "ledger"]


def test_usage_errors(tmp_path: Path, capsys):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    rc, _, err = q(capsys, "plan", "nope", "--at", AT, "--ledger", url)
    assert rc == 1 and "no queue 'nope'" in err
    assert q(capsys, "create", "team", "--max-nodes", "4", "--ledger", url)[0] == 0
    rc, _, err = q(capsys, "create", "team", "--max-nodes", "4", "--ledger", url)
    assert rc == 1 and "already in the ledger" in err
    rc, out, _ = q(capsys, "plan", "team", "--at", AT, "--json", "--ledger", url)
    assert rc == 0 and json.loads(out) == {"jobs": [], "nights": []}
    rc, _, err = q(capsys, "plan", "team", "--at", "2026-06-01T00:00:00", "--ledger", url)
    assert rc == 2 and "--at needs a time zone offset" in err


def test_the_shipped_queue_demo_goes_in_as_it_is(tmp_path: Path, capsys):
    """deployments/queue-demo.yaml, docs/operations.md's example, is accepted with no --hours (the planner's hours);
    a shipped run-now demo is refused for its policy first, not asked for --hours."""
    root = Path(__file__).resolve().parents[3]
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    assert q(capsys, "create", "team", "--max-nodes", "4", "--ledger", url)[0] == 0
    rc, out, err = q(capsys, "add", "team", str(root / "deployments" / "queue-demo.yaml"), "--ledger", url)
    assert rc == 0, err
    assert "job 1 queue-demo: 2 nodes" in out and "(planner: " in out and "policy split" in out
    rc, _, err = q(capsys, "add", "team", str(root / "deployments" / "local-demo.yaml"), "--ledger", url)
    assert rc == 1 and "schedule.policy: 'run-now'" in err and "queue-demo.yaml" in err and "--hours" not in err
    rc, out, _ = q(capsys, "plan", "team", "--at", AT, "--json", "--ledger", url)
    assert rc == 0 and [j["name"] for j in json.loads(out)["jobs"]] == ["queue-demo"]
    assert "queue add team deployments/queue-demo.yaml" in (root / "docs" / "operations.md").read_text()
