"""Shared test settings: one thread per process, analytics off, a per-session PREFECT_HOME."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.3")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


#: fixtures shared across folders (tests/support/): a test names the fixture, it never imports a test module
pytest_plugins = [
    "tests.support.ssh",
    "tests.support.slurm",
    "tests.support.s3",
    "tests.support.postgres",
    "tests.support.xtuner_fixtures",
    "tests.support.gloo",
]


#: `make test` runs every test in one pytest on three xdist workers, one lane (scope) each:
#: - "own-processes": tests that start only their own processes (torchrun --standalone on a free port, XTuner's local
#:   launcher) and run no flow;
#: - "flows": the unit tests and the flows run in this process on local clusters (the local provider takes a free
#:   rendezvous port unless a spec names one), talking to a Prefect server of their own where CI runs one
#:   (NIGHTLOOM_LANE2_PREFECT_API_URL, .ci/services.sh): two lanes' flows on one server queued behind each other (and,
#:   when the servers were on SQLite, answered 503s);
#: - "services": everything that shares the real services (the shared Prefect server and its worker, sshd and Slurm
#:   nodes on the default rendezvous port, Prometheus), in its usual order, exactly as a serial run had it.
#: A serial run left one of the 2 cores idle half the time (real-time windows, polling, start-ups): three lanes fill it.
OWN_PROCESS_TESTS = ("tests/distributed/", "tests/xtuner/")
FLOW_TESTS = ("tests/unit/", "tests/flows/")
SHARED_SERVICES_TESTS = ("tests/xtuner/test_xtuner_pipeline.py",)  # a Prefect flow run by the shared worker
#: own-process tests that run in the flows lane to even the lanes out: in two CI runs of 2026-12-06 the own-processes
#: lane ended 250 s after the flows lane (1861 against 1607 s); these two files took 117 s of it
BALANCE_TO_FLOWS = ("tests/xtuner/test_xtuner_micro_batches.py", "tests/xtuner/test_xtuner_prepare_seed.py")
LANE2_API = os.environ.get("NIGHTLOOM_LANE2_PREFECT_API_URL")


def lane_of(nodeid: str) -> str:
    """The lane (xdist scope) of a test: "own-processes", "flows" or "services"."""
    if nodeid.startswith(SHARED_SERVICES_TESTS):
        return "services"
    if nodeid.startswith(BALANCE_TO_FLOWS):
        return "flows"
    if nodeid.startswith(OWN_PROCESS_TESTS):
        return "own-processes"
    if nodeid.startswith(FLOW_TESTS):
        return "flows"
    return "services"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Under xdist, point the workers of the flows and own-processes lanes at a Prefect server of their own before
    their first fixture (the session's `prefect_backend` included) and before any flow: the environment for child
    processes, Prefect's settings for this one (every thread). Only the flows lane runs flows there; the shared
    server keeps the services lane's load alone. A lane is one xdist scope: its worker keeps it."""
    if not LANE2_API or not os.environ.get("PYTEST_XDIST_WORKER") or lane_of(item.nodeid) == "services":
        return
    if os.environ.get("PREFECT_API_URL") == LANE2_API:
        return
    os.environ["PREFECT_API_URL"] = LANE2_API
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()  # the process-global settings, seen by every thread, re-read from the env


def pytest_xdist_make_scheduler(config, log):
    """Three scopes, one per worker (LoadScopeScheduling hands each worker one whole scope). Not xdist_group markers:
    with pytest 9.2, xdist 3.8's loadgroup cannot tag node ids (nodeid is derived from Node._id), so every test
    became its own scope and services tests ran on both workers at once (503s from the shared server's SQLite,
    EADDRINUSE on the default rendezvous port)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return Lanes(config, log)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def _cpu_seconds() -> float:
    """This process's CPU time and that of its children it has waited for (torchrun, subprocesses)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's CPU seconds ride on its report (xdist sends user_properties to the controller): on a 2-core box
    CPU, not wall, is what the lanes share."""
    report = yield
    start = getattr(item, "_nl_cpu_start", None)
    if start is not None:
        report.user_properties.append(("cpu_s", _cpu_seconds() - start))
    item._nl_cpu_start = _cpu_seconds()  # the next phase starts now
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    item._nl_cpu_start = _cpu_seconds()


def pytest_runtest_logreport(report):
    """With NIGHTLOOM_TEST_TIMES=FILE (CI sets it): one line per test phase, `worker phase seconds nodeid outcome
    cpu_seconds`, so the time of each xdist worker's lane can be summed (the services lane is CI's critical path)."""
    path = os.environ.get("NIGHTLOOM_TEST_TIMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes, for every worker
        return
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None and hasattr(node, "gateway") else "main"
    cpu = dict(report.user_properties).get("cpu_s", float("nan"))
    with open(path, "a") as f:
        f.write(f"{worker}\t{report.when}\t{report.duration:.2f}\t{report.nodeid}\t{report.outcome}\t{cpu:.2f}\n")


@pytest.fixture(scope="session")
def prefect_backend(tmp_path_factory):
    # prefect.main sets up Prefect's logging, whose console handler keeps the sys.stderr of that moment: here, the
    # session's. First imported inside a test using capsys (`from prefect import flow` is lazy), it would keep
    # that test's stream, closed after it, and every later flow's logs would fail (RecursionError in the handler)
    # whenever such a test runs first, e.g. tests/flows/test_windows.py on its own.
    import prefect.main  # noqa: F401

    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    os.environ.setdefault("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-home")))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        from prefect.settings import PREFECT_API_URL

        yield PREFECT_API_URL.value()
