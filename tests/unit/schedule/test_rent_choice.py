"""`nightloom cost SPEC --choose` (issue 42): over three GPU types and their counts, the cheapest option that meets
the deadline is chosen (the cheapest overall does not), each option's hours agree with `nightloom plan`, and when
no option meets the deadline the fastest is chosen with the reason."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from nightloom.schedule.rent_choice import parse_gpu_prices

AT = "2026-06-01T00:00:00+08:00"
GPUS = "h100-80gb=2.5,a100-80gb=1.5,l40s=0.5"
STEPS, SEQ, BATCH = 5000, 4096, 64


def write_spec(tmp_path: Path) -> str:
    spec = {
        "name": "choose",
        "model": {"name": "llama2-7b"},
        "dataset": {"path": "data", "sample": True},
        "cluster": {"provider": "slurm", "nodes": 2, "gpus_per_node": 8, "gpu_type": "h100-80gb"},
        "train": {"steps": STEPS, "seq_len": SEQ, "global_batch": BATCH},
        "schedule": {"timezone": "Asia/Shanghai", "policy": "split", "offpeak_discount": 0.18},
    }
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    return str(p)


def choose(capsys, spec: str, *more) -> tuple[int, dict, str]:
    rc = main(["cost", spec, "--choose", "--gpus", GPUS, "--max-gpus", "24", "--at", AT, "--json", *more])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out else {}, out.err


@pytest.mark.slow
def test_the_cheapest_option_that_meets_the_deadline_and_hours_agree_with_plan(tmp_path: Path, capsys):
    deadline = "2026-06-02T03:10:00+08:00"
    rc, out, err = choose(capsys, write_spec(tmp_path), "--deadline", deadline)
    assert rc == 0, err
    options = out["options"]
    assert {(o["gpu_type"], o["gpus"], o["nodes"]) for o in options} == {
        (t, 8 * n, n) for t in ("h100-80gb", "a100-80gb", "l40s") for n in (1, 2, 3)
    }
    for o in options:
        assert o["meets_deadline"] == (datetime.fromisoformat(o["finish"]) <= datetime.fromisoformat(deadline))
    cheapest = min(options, key=lambda o: o["cost"])
    assert cheapest["meets_deadline"] is False  # the cheapest overall is too slow: the choice must not be it
    meeting = [o for o in options if o["meets_deadline"]]
    best = min(meeting, key=lambda o: o["cost"])
    assert {k: v for k, v in out["choice"].items() if k != "reason"} == best
    assert out["choice"]["reason"].startswith(f"the cheapest of {len(meeting)} options that finish by")
    for o in options:  # each option's hours are `nightloom plan`'s for that type and count
        argv = ["plan", "--model", "llama2-7b", "--gpu", o["gpu_type"], "--nodes", str(o["nodes"])]
        argv += ["--gpus-per-node", "8", "--seq-len", str(SEQ), "--global-batch", str(BATCH), "--json"]
        assert main(argv) == 0
        planned = json.loads(capsys.readouterr().out)["chosen"]
        assert planned["layout"] == o["layout"]
        assert o["hours"] == pytest.approx(planned["step_time_s"] * STEPS / 3600, rel=0.02)


@pytest.mark.slow
def test_none_meets_the_deadline_the_fastest_with_the_reason(tmp_path: Path, capsys):
    rc, out, err = choose(capsys, write_spec(tmp_path), "--deadline", "2026-06-01T03:00:00+08:00")
    assert rc == 1 and "no option can finish by 2026-06-01T03:00:00+08:00" in err
    fastest = min(out["options"], key=lambda o: o["finish"])
    assert out["choice"]["gpus"] == fastest["gpus"] and out["choice"]["gpu_type"] == fastest["gpu_type"]
    assert "the fastest, chosen, misses the deadline" in out["choice"]["reason"]


@pytest.mark.slow
def test_a_budget_rules_out_the_dear_options(tmp_path: Path, capsys):
    rc, out, _ = choose(capsys, write_spec(tmp_path), "--budget", "70")
    assert rc == 0 and out["choice"]["cost"] <= 70 and out["choice"]["gpu_type"] == "l40s"
    rc, _, err = choose(capsys, write_spec(tmp_path), "--budget", "10")
    assert rc == 1 and "cost at most 10.00 USD" in err


def test_usage_errors(tmp_path: Path, capsys):
    spec = write_spec(tmp_path)
    assert main(["cost", spec, "--choose"]) == 2
    assert "--choose needs --gpus" in capsys.readouterr().err
    assert main(["cost", spec, "--choose", "--gpus", "h100-80gb"]) == 2
    assert "expected TYPE=PRICE" in capsys.readouterr().err
    assert main(["cost", spec, "--choose", "--gpus", "h100-80gb=1", "--max-gpus", "4"]) == 2
    assert "less than one node" in capsys.readouterr().err
    with pytest.raises(ValueError, match="twice"):
        parse_gpu_prices("h100-80gb=1,h100-80gb=2")
    rc = main(["cost", spec, "--choose", "--gpus", "nope=1,h100-80gb=2", "--at", AT, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and {r["gpu_type"] for r in out["rejected"]} == {"nope"}
    assert "unknown GPU type 'nope'" in out["rejected"][0]["reason"]


def test_the_demo_s_cost_is_said_to_be_provisioning(capsys):
    """On the demo (30 tiny steps) --choose printed `hours 0.00` and `0.83 USD` as if training cost it."""
    demo = str(Path(__file__).resolve().parents[3] / "deployments" / "local-demo.yaml")
    at = "2026-06-01T12:00:00+08:00"  # peak: 2 GPUs × 10 min × 2.50
    assert main(["cost", demo, "--choose", "--gpus", "h100-80gb=2.5", "--at", at]) == 0
    out = capsys.readouterr().out
    assert "0.83 USD (0.83 provisioning + 0.00 training), training < 1 min" in out
    assert "of it provisioning" in out and "provisioning (10 min a night)" in out and "0.00 │" not in out
    assert main(["cost", demo, "--choose", "--gpus", "h100-80gb=2.5", "--at", at, "--json"]) == 0
    option = json.loads(capsys.readouterr().out)["options"][0]
    assert option["overhead_cost"] == pytest.approx(option["cost"], rel=0.01)


def test_rent_vs_buy_is_not_priced_for_cpu_ranks(capsys):
    demo = str(Path(__file__).resolve().parents[3] / "deployments" / "local-demo.yaml")
    assert main(["cost", demo, "--hours", "0.1", "--at", AT]) == 0
    out = capsys.readouterr().out
    assert "rent vs buy: not compared: gpu_type cpu" in out and "operations alone" not in out
    assert "6 min of training" in out  # not "0.10 h"
    assert main(["cost", demo, "--hours", "0.1", "--at", AT, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rent_vs_buy_not_compared"].startswith("gpu_type cpu")


def test_counts_take_their_noun_in_the_right_number(tmp_path, capsys):
    from nightloom.wording import duration, plural

    assert (plural(1, "node"), plural(2, "node"), plural(1, "family", "families")) == ("1 node", "2 nodes", "1 family")
    assert (duration(0.001), duration(0.5), duration(2)) == ("< 1 min", "30 min", "2.00 h")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    spec = Path(write_spec(tmp_path))
    spec.write_text(spec.read_text().replace("nodes: 2", "nodes: 1"))
    assert main(["queue", "--ledger", url, "create", "team", "--max-nodes", "1"]) == 0
    assert main(["queue", "--ledger", url, "add", "team", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "up to 1 node at once" in out and ": 1 node, " in out and "1 nodes" not in out
