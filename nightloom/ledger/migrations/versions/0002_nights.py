"""Schema 2: the nullable `nights` JSON column (per-night predicted vs actual); rows from schema 1 read as no nights.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa

from nightloom.ledger.migrations import add_run_columns, drop_run_columns, set_legacy_version

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_run_columns(sa.Column("nights", sa.JSON(), nullable=True))
    set_legacy_version(2)


def downgrade() -> None:
    drop_run_columns("nights")
    set_legacy_version(1)
