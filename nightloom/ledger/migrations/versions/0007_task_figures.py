"""Schema 7: each run's `task` (pretrain, sft, dpo, ...) and its `figures` (nightloom.ledger.records.Figure: the
task's own results beside the gates, e.g. a preference run's reward accuracy or a benchmark's base and tuned
scores). Rows written before get the task their run folder's job*.json trained where one is left, else "" (not
known), and no figures. Offline (`--sql`) only the columns are added.

Revision ID: 0007
Revises: 0006
"""

from pathlib import Path

import sqlalchemy as sa
from alembic import op

from nightloom.ledger.migrations import add_run_columns, drop_run_columns, set_legacy_version
from nightloom.ledger.model import run_task_from_job

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

RUNS = sa.table("nightloom_runs", sa.column("run_id"), sa.column("task"), sa.column("metrics_path"))


def _fill_tasks(conn: sa.Connection) -> None:
    """Every row's task from its run folder's job file where one is left."""
    for run_id, metrics_path in conn.execute(sa.select(RUNS.c.run_id, RUNS.c.metrics_path)).all():
        task = run_task_from_job(Path(metrics_path).parent) if metrics_path else None
        if task:
            conn.execute(RUNS.update().where(RUNS.c.run_id == run_id).values(task=task))


def upgrade() -> None:
    add_run_columns(
        sa.Column("task", sa.String(16), nullable=False, server_default=""),
        sa.Column("figures", sa.JSON(), nullable=True),
    )
    if not op.get_context().as_sql:
        _fill_tasks(op.get_bind())
    set_legacy_version(7)


def downgrade() -> None:
    drop_run_columns("figures", "task")
    set_legacy_version(6)
