"""`nightloom run` prints each gate as pass, FAIL, SKIP or "not gated": a gate that did not run never reads "pass"."""

from flows.commands.run import print_summary
from nightloom.gates import Verdict
from nightloom.report import RunSummary


def test_skipped_gates_are_not_printed_as_pass(capsys):
    verdicts = [
        Verdict(name="mfu_floor", passed=True, skipped=True, measured=0.04, reason="MFU 4.01%; no floor set"),
        Verdict(name="grad_norm", passed=True, skipped=True, reason="grad_norm_max not set"),
        Verdict(name="loss_drop", passed=True, measured=0.3, threshold=0.05, reason="drop 30%"),
        Verdict(name="spikes", passed=False, measured=12.0, threshold=8.0, reason="loss spike at step 9"),
    ]
    s = RunSummary(run_id="r", name="n", status="failed", verdicts=[v.model_dump() for v in verdicts])
    print_summary(s)
    lines = {
        ln.split("│")[1].strip(): ln.split("│")[2].strip()
        for ln in capsys.readouterr().out.splitlines()
        if ln.count("│") >= 3 and "gate" in ln
    }
    assert lines["gate mfu_floor"].startswith("not gated: MFU 4.01%")
    assert lines["gate grad_norm"].startswith("SKIP: grad_norm_max")
    assert lines["gate loss_drop"].startswith("pass: ")
    assert lines["gate spikes"].startswith("FAIL: ")


def test_unmeasured_figures_read_n_a_not_a_dash(capsys):
    """A figure that was not measured or predicted prints "n/a" (a lone "-" reads as a bullet in Markdown)."""
    print_summary(RunSummary(run_id="r", name="n", status="completed", mfu=0.05, mfu_predicted=None))
    out = capsys.readouterr().out
    assert "planned n/a" in out and "planned -" not in out
