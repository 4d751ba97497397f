"""Schema 4: what the nightly-queue deployment ran (issue 42): `nightloom_queue_runs`, one row per job per night
(the night's window start, the stretch the plan gave it, the pipeline run and Prefect flow run, the status, steps
trained so far and hours trained that night). The runs, queues and jobs tables are untouched.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

from nightloom.ledger.migrations import set_legacy_version

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

RUNS = "nightloom_queue_runs"


def upgrade() -> None:
    op.create_table(
        RUNS,
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("queue", sa.String(128), sa.ForeignKey("nightloom_queues.name"), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),  # no foreign key: a removed job's runs stay recorded
        sa.Column(
            "night", sa.DateTime(), nullable=False
        ),  # the window's start, naive UTC (nightloom.ledger.engine.UTCDateTime)
        sa.Column("segment_start", sa.DateTime(), nullable=False),
        sa.Column("segment_end", sa.DateTime(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),  # the node indices the plan gave the stretch
        sa.Column("run_id", sa.String(128), nullable=True),  # the pipeline's run (ledger row, run folder)
        sa.Column("flow_run_id", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),  # the pipeline run's status, or crashed
        sa.Column("job_status", sa.String(16), nullable=False),  # what the night made of the job
        sa.Column("steps_done", sa.Integer(), nullable=False),
        sa.Column("hours_trained", sa.Float(), nullable=False),
        sa.Column("reason", sa.String(2048), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index(f"ix_{RUNS}_queue", RUNS, ["queue"])
    set_legacy_version(4)


def downgrade() -> None:
    op.drop_index(f"ix_{RUNS}_queue", table_name=RUNS)
    op.drop_table(RUNS)
    set_legacy_version(3)
