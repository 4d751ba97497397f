"""Long values wrap instead of being cut at a table's edge: the terminal run summary and the plan's table fold a
long path onto more lines (rich's default cuts it with "…"), and the table artifacts (run-summary, the plan's
rejected layouts), whose cells Prefect's UI does not wrap, continue a long text on rows of their own."""

from __future__ import annotations

from flows.commands.run import print_summary
from nightloom.report import ARTIFACT_LINE, RunSummary, wrapped_rows

LONG_PATH = "/data/teams/pretraining/.nightloom/runs/local-demo/20261205-023000-5f0c2a9e1b7d/export/adapter"
LONG_REASON = (
    "heads (4) and kv_heads (2) must be divisible by tp (8); the layout needs 93.4 GiB per GPU of 79.1 GiB usable "
    "(parameters 40.2, gradients 40.2, optimizer states 10.1, activations 2.9)"
)


def _cells(out: str, column: int) -> str:
    """One column of a rich table's text, its lines joined (a wrapped value read back whole)."""
    parts = [ln.split("│")[column].strip() for ln in out.splitlines() if ln.count("│") > column]
    return "".join(parts)


def test_terminal_summary_wraps_a_long_path(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    print_summary(RunSummary(run_id="r", name="n", status="failed", reason=LONG_PATH))
    out = capsys.readouterr().out
    assert "…" not in out
    assert LONG_PATH in _cells(out, 2)


def test_plan_artifact_continues_a_long_reject_reason():
    """The plan artifact's rejected rows (tasks/plan.py): the reason goes on, the other cells blank."""
    row = {"status": "rejected", "layout": "TP8 PP2", "mem_gib": None, "reason": LONG_REASON}
    rows = wrapped_rows([{"status": "chosen", "layout": "DP16", "mem_gib": 40.1, "reason": None}, row], "reason")
    assert rows[0]["reason"] is None and rows[1] == {**row, "reason": rows[1]["reason"]}
    assert all(r == {"status": "", "layout": "", "mem_gib": "", "reason": r["reason"]} for r in rows[2:])
    assert " ".join(r["reason"] for r in rows[1:]) == LONG_REASON
    assert all(len(r["reason"]) <= ARTIFACT_LINE for r in rows[1:])


def test_artifact_rows_continue_a_long_value():
    rows = wrapped_rows([{"field": "gate loss", "value": LONG_REASON}, {"field": "export", "value": LONG_PATH}])
    gate = [r for r in rows if r["field"] in ("gate loss", "")]
    assert gate[0]["field"] == "gate loss" and len(gate) > 1
    assert all(len(r["value"]) <= ARTIFACT_LINE for r in gate)
    assert " ".join(r["value"] for r in gate) == LONG_REASON
    assert {"field": "export", "value": LONG_PATH} in rows  # one word: whole, to be copied
    assert wrapped_rows([{"field": "status", "value": "passed"}]) == [{"field": "status", "value": "passed"}]
