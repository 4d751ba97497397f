"""Schema 3: the night queue (issue 42): `nightloom_queues` (name, max nodes, nightly budget, the schedule its first
job gave) and `nightloom_queue_jobs` (one row per job: priority, deadline, nodes, predicted hours and the figures
the plan needs, the spec itself). The runs table is untouched.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

from nightloom.ledger.migrations import set_legacy_version

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

QUEUES = "nightloom_queues"
JOBS = "nightloom_queue_jobs"


def upgrade() -> None:
    op.create_table(
        QUEUES,
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("max_nodes", sa.Integer(), nullable=False),
        sa.Column("budget_per_night", sa.Float(), nullable=True),
        sa.Column("schedule", sa.JSON(), nullable=True),  # a ScheduleSpec; NULL until the first job sets it
        sa.Column("created_at", sa.DateTime(), nullable=False),  # naive UTC (nightloom.ledger.engine.UTCDateTime)
    )
    op.create_table(
        JOBS,
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("queue", sa.String(128), sa.ForeignKey(f"{QUEUES}.name"), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("deadline", sa.DateTime(), nullable=True),
        sa.Column("added_at", sa.DateTime(), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("policy", sa.String(16), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("step_time_s", sa.Float(), nullable=False),
        sa.Column("hours_source", sa.String(512), nullable=False),
        sa.Column("provisioning_s", sa.Float(), nullable=False),
        sa.Column("checkpoint_s", sa.Float(), nullable=False),
        sa.Column("restore_s", sa.Float(), nullable=False),
        sa.Column("schedule", sa.JSON(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("spec_path", sa.String(1024), nullable=True),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sqlite_autoincrement=True,  # SQLite: a removed job's id is never handed to a new one
    )
    op.create_index(f"ix_{JOBS}_queue", JOBS, ["queue"])
    set_legacy_version(3)


def downgrade() -> None:
    op.drop_index(f"ix_{JOBS}_queue", table_name=JOBS)
    op.drop_table(JOBS)
    op.drop_table(QUEUES)
    set_legacy_version(2)
