"""The run-summary artifact's cells: nothing the Prefect UI's markdown would turn into a list bullet."""

from __future__ import annotations

import re

from nightloom.report import NOT_MEASURED, RunSummary, StageTime, summary_rows
from nightloom.validate import Verdict

LIST_MARKER = re.compile(r"^\s*([-*+]|\d+\.)(\s|$)")  # what markdown renders as a list item


def _summary(**kw) -> RunSummary:
    base = dict(run_id="r1", name="demo", status="completed", shards=4, shard_imbalance=0.01, layout="DP2")
    base.update(world_size=2, first_loss=5.5, last_loss=4.1, steps=12)
    return RunSummary(**(base | kw))


def test_missing_figures_read_not_measured_and_no_cell_is_a_list_item():
    verdicts = [Verdict(name="mfu_floor", passed=True, skipped=True, reason="no floor set")]
    rows = summary_rows(_summary(), verdicts, 1.5, 0.0, "USD", [StageTime(stage="train", seconds=3.0)])
    values = {r["field"]: r["value"] for r in rows}
    assert values["tokens/s"] == values["MFU"] == values["MFU planned"] == NOT_MEASURED
    assert not [r for r in rows if LIST_MARKER.match(r["value"])], rows


def test_measured_figures_are_formatted():
    s = _summary(tokens_per_s=12345.6, mfu=0.0412, mfu_predicted=0.05, peak_source="measured: CPU matmul")
    values = {r["field"]: r["value"] for r in summary_rows(s, [], 2.0, 1.25, "USD", [])}
    assert values["tokens/s"] == "12,346"
    assert values["MFU"] == "4.12% (measured: CPU matmul)" and values["MFU planned"] == "5.00%"
    assert values["cost"] == "1.25 USD"
