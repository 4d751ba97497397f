"""Every view of a run's summary (terminal, the Prefect run-summary artifact, Jupyter) names the export and the
adapter folders, read from the run's result record, whichever backend wrote it; a run without them shows no row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flows.commands.run import print_summary
from nightloom.report import RunSummary, summary_rows
from nightloom.train.job import TrainResult

EXPORT = "/runs/chat-sft-demo/r1/export"
ADAPTER = "/runs/chat-sft-demo/r1/export/adapter"


def _trained(result) -> SimpleNamespace:
    """What add_training reads of a TrainOutcome."""
    plan = SimpleNamespace(layout=lambda: "DP2")
    cluster = SimpleNamespace(world_size=2)
    return SimpleNamespace(
        result=result, plan=plan, cluster=cluster, interruptions=0, recovery_s=0.0, preemptions=0, preemption_lost_s=0.0
    )


def _summary(result) -> RunSummary:
    s = RunSummary(run_id="r1", name="chat-sft-demo", status="completed", run_dir="/runs/r1", shard_imbalance=0.0)
    s.add_training(_trained(result), None)
    return s


def _native(**kw) -> TrainResult:
    return TrainResult(steps_done=30, total_steps=30, stopped="completed", final_loss=1.0, tokens=1, wall_s=1.0, **kw)


def _views(s: RunSummary, capsys) -> dict[str, str]:
    """The terminal's lines, the artifact's rows and the notebook's HTML, as text."""
    print_summary(s)
    rows = summary_rows(s, [], 0.0, 0.0, "USD", [])
    return {
        "terminal": capsys.readouterr().out,
        "artifact": "\n".join(f"{r['field']}: {r['value']}" for r in rows),
        "notebook": s._repr_html_(),
    }


def test_a_lora_run_names_its_export_and_adapter_everywhere(capsys):
    s = _summary(_native(export_dir=EXPORT, adapter_dir=ADAPTER))
    assert (s.export_dir, s.adapter_dir) == (EXPORT, ADAPTER)
    assert s.output_rows() == [("export", EXPORT), ("adapter", ADAPTER)]
    views = _views(s, capsys)
    assert f"export:     {EXPORT}\n" in views["terminal"] and f"adapter:    {ADAPTER}\n" in views["terminal"]
    assert f"export: {EXPORT}" in views["artifact"] and f"adapter: {ADAPTER}" in views["artifact"]
    assert f"<td style='text-align:left'>{ADAPTER}</td>" in views["notebook"]
    assert RunSummary.model_validate_json(s.model_dump_json()).adapter_dir == ADAPTER  # `run --json` carries it


def test_a_run_without_an_export_shows_no_such_row(capsys):
    s = _summary(_native())
    assert s.output_rows() == []
    for view in _views(s, capsys).values():
        assert "export" not in view.lower() and "adapter" not in view.lower()


@pytest.mark.parametrize("lora", [True, False], ids=["adapter", "full"])
def test_an_xtuner_result_fills_the_same_rows(capsys, lora):
    from nightloom.finetune.run import XTunerResult

    common = dict(steps_done=3, total_steps=3, stopped="completed", final_loss=1.0, tokens=1, wall_s=1.0)
    out = "/runs/x/r2/export/" + ("adapter" if lora else "model")
    result = XTunerResult(
        **common, metrics_path="m", config_path="c", adapter_dir=out if lora else None, model_dir=None if lora else out
    )
    s = _summary(result)
    assert s.output_rows() == ([("adapter", out)] if lora else [("export", out)])
    assert out in _views(s, capsys)["artifact"]
