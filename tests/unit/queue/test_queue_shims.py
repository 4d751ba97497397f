"""The night queue's old module paths (before nightloom/queue/ was a package) still import for one release: each
warns, naming its new home, and hands out the very objects of that home (the old job records are the queue's one
record, QueuedJob); nothing in the project imports them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from nightloom.queue.jobs import QueuedJob
from tests.support.aliases import alias_users, import_alias

ROOT = Path(__file__).resolve().parents[3]

#: old module -> its new home(s)
SHIMS = {
    "nightloom.queue_store": ("nightloom.queue.store", "nightloom.queue.jobs"),
    "nightloom.schedule.queue_jobs": ("nightloom.queue.jobs",),
    "nightloom.schedule.queue_plan": ("nightloom.queue.timetable", "nightloom.queue.jobs"),
    "nightloom.schedule.queue_night": ("nightloom.queue.tonight",),
    "nightloom.schedule.queue_gantt": ("nightloom.queue.gantt",),
}
RENAMED = {"JobFigures": QueuedJob, "PlanJob": QueuedJob}


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_an_old_queue_module_warns_and_re_exports(old, monkeypatch):
    shim = import_alias(old, SHIMS[old][0], monkeypatch)
    homes = [importlib.import_module(n) for n in SHIMS[old]]
    for name in shim.__all__:
        want = RENAMED.get(name) or next(getattr(h, name) for h in homes if hasattr(h, name))
        assert getattr(shim, name) is want, name


def test_the_queue_has_one_job_record():
    """The store keeps, the plan packs and a night runs the same class; no other module declares a job's hours."""
    from nightloom.queue import store, timetable, tonight

    assert store.QueuedJob is timetable.QueuedJob is tonight.QueuedJob is QueuedJob
    owners = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "nightloom").rglob("*.py")
        if "def hours(self)" in p.read_text(encoding="utf-8") and "queue" in p.as_posix()
    )
    assert owners == ["nightloom/queue/jobs.py"]


def test_no_project_code_imports_an_old_queue_module():
    users = alias_users(set(SHIMS))
    assert not users, "import the new paths:\n  " + "\n  ".join(users)
