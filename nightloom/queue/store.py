"""The night queues kept in the run ledger's database (schema 3, and 4 for their runs): queues, their jobs and what
the nightly-queue deployment ran for each job each night, typed, over the ledger's engine and its retrying
transactions.

A queue has a name, the most nodes it holds at once, an optional budget per night, and the schedule its first job
gave (time zone, windows, currency; cleared when its last job leaves). `add` checks a job against the queue inside
the transaction that inserts it (nightloom.queue.jobs.refusals), so a refused job leaves the queue exactly
as it was. Job ids are never reused, so a removed job's id names nothing afterwards.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel
from sqlalchemy import JSON, Float, ForeignKey, Integer, String, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from nightloom.ledger import Ledger, LedgerError
from nightloom.ledger.engine import UTCDateTime
from nightloom.queue.jobs import QueuedJob, QueueRefused, refusals
from nightloom.queue.tonight import JOB_STATUSES, JobProgress, remaining
from nightloom.records import Record, field_type
from nightloom.spec import ScheduleSpec

__all__ = ["QueueError", "QueueRecord", "QueueRefused", "QueueRun", "QueueStore", "QueuedJob", "queue_metadata"]


class QueueError(LedgerError):
    """A queue that does not exist or already does, or a job id not in the queue; the message says which."""


# ---------------------------------------------------------------------------------------------- records


class QueueRecord(Record):
    """One queue, typed."""

    name: str
    max_nodes: int
    budget_per_night: float | None = None
    schedule: ScheduleSpec | None = None  # the first job's; None while the queue is empty
    created_at: datetime


class QueueRun(Record):
    """What one job's night did: the stretch the plan gave it, the pipeline run and flow run, the run's status and
    the job's status after it, steps trained so far and the hours trained that night."""

    id: int | None = None
    queue: str
    job_id: int
    night: datetime  # the window's start
    segment_start: datetime
    segment_end: datetime
    nodes: list[int]
    run_id: str | None = None
    flow_run_id: str | None = None
    status: str  # the pipeline run's: completed | split | stopped | failed | deferred | refused | crashed
    job_status: str  # queued | split | done (nightloom.queue.tonight.night_outcome)
    steps_done: int
    hours_trained: float
    reason: str = ""
    started_at: datetime
    finished_at: datetime


# ---------------------------------------------------------------------------------------------- tables


class _QueueBase(DeclarativeBase):
    """The queue tables' declarative base."""


queue_metadata = _QueueBase.metadata  # the queue tables (the runs table is nightloom.ledger's)

#: the length of each text column (the 0003 revision's); every other column's type follows its record's field
_TEXT_LENGTH = {
    "name": 128,
    "status": 16,
    "policy": 16,
    "hours_source": 512,
    "spec_path": 1024,
    "spec_hash": 64,
    "run_id": 128,
    "flow_run_id": 64,
    "job_status": 16,
    "reason": 2048,
}
#: fields a record leaves empty until the store fills them in: NOT NULL in the table
_FILLED_BY_STORE = {"added_at"}
_TYPES = {int: Integer, float: Float, datetime: UTCDateTime}  # a field's type -> its column's; JSON otherwise


def _column(record: type[BaseModel], name: str):
    """The column of one record field: text of its _TEXT_LENGTH, INTEGER, FLOAT (the 0003 revision's type, not
    SQLAlchemy's default DOUBLE), a UTC datetime, or JSON (lists, mappings, the schedule); NULL where the field
    may be None."""
    kind, optional = field_type(record, name)
    if kind is str and name not in _TEXT_LENGTH:
        raise TypeError(f"{record.__name__}.{name} is text: give its column's length in _TEXT_LENGTH (and a migration)")
    sql = String(_TEXT_LENGTH[name]) if kind is str else _TYPES.get(kind, JSON)
    return mapped_column(sql, nullable=optional and name not in _FILLED_BY_STORE)


def _table(class_name: str, table: str, record: type[BaseModel], bases: tuple, **given):
    """The mapped class of `table`: a column for each of the record's fields, but those `given` (the keys) and
    those a base declares."""
    declared = {c for b in bases for c in getattr(b, "__annotations__", {})}
    columns = {n: _column(record, n) for n in record.model_fields if n not in given and n not in declared}
    return type(class_name, bases, {"__tablename__": table, **given, **columns})


class _InQueue:
    """A row that belongs to one queue: its id is never handed to a new row once removed (SQLite's
    AUTOINCREMENT), so an id names one job or one night's run for good."""

    __table_args__ = {"sqlite_autoincrement": True}
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True, sort_order=-2)
    queue: Mapped[str] = mapped_column(String(128), ForeignKey("nightloom_queues.name"), index=True, sort_order=-1)


# the queue tables, one column per field of their records (QueueRecord, QueuedJob, QueueRun)
_Queue = _table(
    "_Queue", "nightloom_queues", QueueRecord, (_QueueBase,), name=mapped_column(String(128), primary_key=True)
)
_Job = _table("_Job", "nightloom_queue_jobs", QueuedJob, (_InQueue, _QueueBase))
_Run = _table("_Run", "nightloom_queue_runs", QueueRun, (_InQueue, _QueueBase))


def _typed(record: type[BaseModel], row: _QueueBase):
    """A table row as its record (QueueRecord, QueuedJob, QueueRun: each has exactly its table's columns)."""
    return record.model_validate({c.name: getattr(row, c.name) for c in row.__table__.columns})


# ---------------------------------------------------------------------------------------------- the store


class QueueStore:
    """The queues of the ledger `ledger` (open it first: opening migrates it to schema 3)."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def _tx(self, fn):
        """Run `fn(session)` in one transaction, retried as the ledger's own writes are (SQLite's lock errors,
        PostgreSQL's serialization failures and deadlocks: nightloom.ledger.engine.retry)."""

        def tx():
            with Session(self.ledger.engine, expire_on_commit=False) as s, s.begin():
                return fn(s)

        return self.ledger.retry(tx)

    def _queue_row(self, s: Session, name: str, *, lock: bool = False) -> _Queue:
        q = select(_Queue).where(_Queue.name == name)
        row = s.execute(q.with_for_update() if lock else q).scalar_one_or_none()
        if row is None:
            raise QueueError(f"no queue {name!r} in the ledger {self.ledger.where()}: create it first")
        return row

    def create(
        self, name: str, max_nodes: int, budget_per_night: float | None = None, *, created_at: datetime | None = None
    ) -> QueueRecord:
        """A new, empty queue; a name already used is an error."""
        if max_nodes < 1:
            raise QueueError(f"--max-nodes must be >= 1, got {max_nodes}")
        if budget_per_night is not None and budget_per_night <= 0:
            raise QueueError(f"--budget-per-night must be > 0, got {budget_per_night}")
        row = _Queue(
            name=name,
            max_nodes=max_nodes,
            budget_per_night=budget_per_night,
            created_at=created_at or datetime.now(UTC),
        )

        def fn(s: Session) -> None:
            s.add(row)

        try:
            self._tx(fn)
        except IntegrityError:
            raise QueueError(f"queue {name!r} is already in the ledger {self.ledger.where()}") from None
        return self.get(name)

    def get(self, name: str) -> QueueRecord:
        return self._tx(lambda s: _typed(QueueRecord, self._queue_row(s, name)))

    def names(self) -> list[str]:
        return self._tx(lambda s: list(s.execute(select(_Queue.name).order_by(_Queue.name)).scalars()))

    def jobs(self, name: str) -> list[QueuedJob]:
        """The queue's jobs in the order they were added."""

        def fn(s: Session) -> list[QueuedJob]:
            self._queue_row(s, name)
            rows = s.execute(select(_Job).where(_Job.queue == name).order_by(_Job.id)).scalars()
            return [_typed(QueuedJob, r) for r in rows]

        return self._tx(fn)

    def add(
        self,
        name: str,
        job: QueuedJob,
        *,
        spec: dict[str, Any],
        priority: int = 1,
        deadline: datetime | None = None,
        spec_path: str | None = None,
        added_at: datetime | None = None,
    ) -> QueuedJob:
        """Add a job, or raise QueueRefused naming every reason with the queue unchanged (the check and the
        insert are one transaction). The first job sets the queue's schedule."""
        if priority < 1:
            raise QueueRefused(f"--priority must be >= 1 (1 runs first), got {priority}")
        if deadline is not None and deadline.tzinfo is None:
            raise QueueRefused(f"--deadline needs a time zone offset, got {deadline.isoformat()}")

        def fn(s: Session) -> QueuedJob:
            q = self._queue_row(s, name, lock=True)
            sched = None if q.schedule is None else ScheduleSpec.model_validate(q.schedule)
            why = refusals(job, max_nodes=q.max_nodes, queue_schedule=sched)
            if why:
                raise QueueRefused(f"queue {name!r} refuses {job.name}: " + "; ".join(why))
            sched_json = job.schedule.model_dump(mode="json")
            if q.schedule is None:
                q.schedule = sched_json
            placed = job.model_copy(
                update={
                    "queue": name,
                    "status": "queued",
                    "priority": priority,
                    "deadline": deadline,
                    "added_at": added_at or datetime.now(UTC),
                    "spec": spec,
                    "spec_path": spec_path,
                }
            )
            row = _Job(**placed.model_dump(mode="python", exclude={"id", "schedule"}), schedule=sched_json)
            s.add(row)
            s.flush()
            return _typed(QueuedJob, row)

        return self._tx(fn)

    def remove(self, name: str, job_id: int) -> QueuedJob:
        """Take a job out of the queue; the last one out clears the queue's schedule."""

        def fn(s: Session) -> QueuedJob:
            q = self._queue_row(s, name, lock=True)
            row = s.execute(select(_Job).where(_Job.queue == name, _Job.id == job_id)).scalar_one_or_none()
            if row is None:
                raise QueueError(f"no job {job_id} in queue {name!r}")
            rec = _typed(QueuedJob, row)
            s.delete(row)
            s.flush()
            if s.execute(select(_Job.id).where(_Job.queue == name).limit(1)).first() is None:
                q.schedule = None
            return rec

        return self._tx(fn)

    # ------------------------------------------------------------------------------------------ what ran

    def record_run(self, run: QueueRun) -> QueueRun:
        """Record one job's night and set the job's status to what the night made of it, in one transaction."""
        if run.job_status not in JOB_STATUSES:
            raise QueueError(f"job status {run.job_status!r} is not one of {', '.join(JOB_STATUSES)}")

        def fn(s: Session) -> QueueRun:
            self._queue_row(s, run.queue)
            row = _Run(**run.model_dump(exclude={"id"}, mode="python"))
            s.add(row)
            job = s.execute(select(_Job).where(_Job.queue == run.queue, _Job.id == run.job_id)).scalar_one_or_none()
            if job is not None:
                job.status = run.job_status
            s.flush()
            return _typed(QueueRun, row)

        return self._tx(fn)

    def runs(self, name: str, job_id: int | None = None) -> list[QueueRun]:
        """What ran in the queue (or for one job), in the order it was recorded."""

        def fn(s: Session) -> list[QueueRun]:
            self._queue_row(s, name)
            q = select(_Run).where(_Run.queue == name)
            if job_id is not None:
                q = q.where(_Run.job_id == job_id)
            rows = s.execute(q.order_by(_Run.id)).scalars()
            return [_typed(QueueRun, r) for r in rows]

        return self._tx(fn)

    def progress(self, name: str) -> dict[int, JobProgress]:
        """Each job's progress from its recorded nights: steps trained, the run a later night resumes (the newest
        that has one), its status, the nights it ran."""
        out: dict[int, JobProgress] = {}
        for r in self.runs(name):
            before = out.get(r.job_id, JobProgress(r.job_id))
            out[r.job_id] = JobProgress(
                job_id=r.job_id,
                steps_done=max(before.steps_done, r.steps_done),
                run_id=r.run_id or before.run_id,
                status=r.job_status,
                nights=before.nights + 1,
            )
        return out

    def plan_jobs(self, name: str) -> list[QueuedJob]:
        """The queue's jobs as the plan should see them now: finished ones left out, the others with the steps they
        have left (nightloom.queue.tonight.remaining)."""
        prog = self.progress(name)
        jobs = [remaining(j, prog.get(j.id)) for j in self.jobs(name) if j.status != "done"]
        return [j for j in jobs if j is not None]
