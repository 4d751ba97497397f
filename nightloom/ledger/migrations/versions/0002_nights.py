"""Schema 2: the nullable `nights` JSON column (per-night predicted vs actual); rows from schema 1 read as no nights.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

from nightloom.ledger.migrations import set_legacy_version

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nightloom_runs") as batch:  # batch: SQLite alters by copying when it must
        batch.add_column(sa.Column("nights", sa.JSON(), nullable=True))
    set_legacy_version(2)


def downgrade() -> None:
    with op.batch_alter_table("nightloom_runs") as batch:
        batch.drop_column("nights")
    set_legacy_version(1)
