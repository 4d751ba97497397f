"""What a reader sees of a RunSummary: the terminal table (run dir whole, one loss precision, cost only where a
price is set) and Jupyter's display (a table and the loss curve inline)."""

from __future__ import annotations

import base64
import json

from flows.commands.run import print_summary
from nightloom.gates import Verdict
from nightloom.report import RunSummary, StageTime, summary_rows

LONG = "/work/a/rather/long/checkout/path/.nightloom/runs/local-demo-20261204-041902-3bafc307"


def summary(**over) -> RunSummary:
    base = dict(
        run_id="local-demo-20261204-041902-3bafc307",
        name="local-demo",
        status="completed",
        run_dir=LONG,
        layout="TP1·PP1·DP4",
        shards=8,
        shard_imbalance=0.0077,
        world_size=4,
        steps=30,
        first_loss=6.24571,
        last_loss=5.27,
        cost=0.0,
        currency="USD",
        verdicts=[Verdict(name="loss_drop", passed=True, measured=0.13, threshold=0.05, reason="drop 13%")],
        stages=[StageTime(stage="train", seconds=12.7)],
    )
    return RunSummary(**{**base, **over})


def test_terminal_prints_the_run_dir_whole_and_losses_at_one_precision(capsys):
    print_summary(summary())
    out = capsys.readouterr().out
    assert f"run dir:    {LONG}\n" in out
    assert "6.2457 -> 5.2700 over 30 steps" in out
    assert "cost" not in out and "nights" not in out  # no price set


def test_cost_and_nights_show_where_a_price_is_set(capsys):
    print_summary(summary(cost=12.5, nights_used=1, nights_left=2))
    out = capsys.readouterr().out
    assert "12.50 USD" in out and "1 used, 2 left" in out


def test_artifact_rows_share_the_loss_text_and_leave_out_a_zero_cost():
    rows = {r["field"]: r["value"] for r in summary_rows(summary(), [], 1.0, 0.0, "USD", [])}
    assert rows["loss"] == "6.2457 -> 5.2700 over 30 steps"
    assert "cost" not in rows and "nights" not in rows


def test_html_display_has_status_layout_losses_gates_and_the_loss_curve(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"step": s, "loss": 6.0 - 0.1 * s, "ts": 1000.0 + s} for s in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    html = summary(run_dir=str(run_dir))._repr_html_()
    for text in ("completed", "TP1·PP1·DP4 on 4 ranks", "6.2457 -&gt; 5.2700", "gate loss_drop", "pass: drop 13%"):
        assert text in html, text
    png = html.split("data:image/png;base64,")[1].split("'")[0]
    assert base64.b64decode(png).startswith(b"\x89PNG")


def test_html_display_without_metrics_has_no_image():
    assert "<img" not in summary(run_dir="/nonexistent")._repr_html_()
