"""Schema 1: the runs table and its indexes as nightloom created them before Alembic, and the legacy version row.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

from nightloom.ledger.migrations import LEGACY_TABLE

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

RUNS = "nightloom_runs"
INDEXED = ("spec_hash", "model", "cluster", "gpu_type", "status")


def upgrade() -> None:
    legacy = op.create_table(
        LEGACY_TABLE,
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
    )
    op.bulk_insert(legacy, [{"id": 1, "version": 1}])
    op.create_table(
        RUNS,
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("cluster", sa.String(128), nullable=False),
        sa.Column("provider", sa.String(32), nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("layout", sa.String(128), nullable=True),
        sa.Column("plan", sa.JSON(), nullable=True),
        sa.Column("predicted_mfu", sa.Float(), nullable=True),
        sa.Column("measured_mfu", sa.Float(), nullable=True),
        sa.Column("hfu", sa.Float(), nullable=True),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("final_loss", sa.Float(), nullable=True),
        sa.Column("time_to_ready_s", sa.Float(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("cost", sa.Float(), nullable=True),
        sa.Column("currency", sa.String(8), nullable=False),
        sa.Column("precision", sa.String(16), nullable=True),
        sa.Column("peak_source", sa.String(512), nullable=True),
        sa.Column("verdicts", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(2048), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),  # naive UTC (nightloom.ledger.engine.UTCDateTime)
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("interruptions", sa.JSON(), nullable=False),
        sa.Column("interruption_count", sa.Integer(), nullable=False),
        sa.Column("recovery_s", sa.Float(), nullable=False),
        sa.Column("metrics_path", sa.String(1024), nullable=True),
    )
    for col in INDEXED:
        op.create_index(f"ix_{RUNS}_{col}", RUNS, [col])


def downgrade() -> None:
    for col in INDEXED:
        op.drop_index(f"ix_{RUNS}_{col}", table_name=RUNS)
    op.drop_table(RUNS)
    op.drop_table(LEGACY_TABLE)
