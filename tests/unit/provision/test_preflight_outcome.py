"""Preflight outcomes: passed only when every node was checked and passed; an empty or crashed preflight is
"unknown", and recovery never writes "preflight passed on every node" for it."""

from nightloom.provision.base import Check, NodeReport, PreflightReport
from nightloom.recovery import AttemptFailure, classify

FAILURE = AttemptFailure(attempt=1, exit_code=1, stalled=False, cause="worker exited", last_step=3)
OK = [NodeReport(node="n0", ok=True), NodeReport(node="n1", ok=True)]


def test_outcomes():
    assert PreflightReport(nodes=OK).outcome == "passed"
    assert PreflightReport(nodes=OK, allreduce_ok=True).outcome == "passed"
    assert PreflightReport(nodes=OK, allreduce_ok=False).outcome == "failed"
    sick = NodeReport(node="n1", ok=False, checks=[Check(name="gpus", ok=False, detail="0 × H100")])
    assert PreflightReport(nodes=[OK[0], sick]).outcome == "failed"
    empty = PreflightReport(nodes=[])
    assert empty.outcome == "unknown" and empty.unknown_reason == "no node was checked"
    said = PreflightReport(nodes=OK, unknown="probe timed out")
    assert said.outcome == "unknown" and said.unknown_reason == "probe timed out"


def test_recovery_names_an_unknown_preflight_never_a_pass():
    passed = classify(FAILURE, PreflightReport(nodes=OK))
    assert passed.kind == "transient" and passed.detail.endswith("preflight passed on every node")
    crashed = PreflightReport(nodes=[], unknown="preflight crashed: OSError: no route to host")
    for report, why in [
        (PreflightReport(nodes=[]), "no node was checked"),
        (crashed, "preflight crashed: OSError: no route to host"),
        (None, "no report"),
    ]:
        d = classify(FAILURE, report)
        assert d.kind == "transient" and d.bad_nodes == {}
        assert d.detail.endswith(f"preflight outcome unknown: {why}") and "passed" not in d.detail, d.detail
