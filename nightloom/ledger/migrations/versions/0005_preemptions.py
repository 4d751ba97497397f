"""Schema 5: a run's preemptions apart from its failures: `preemptions` (attempts stopped by a preemption notice,
each saved at one agreed step) and `preemption_lost_s` (their time lost); rows written before read as 0 and 0.0.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa

from nightloom.ledger.migrations import add_run_columns, drop_run_columns, set_legacy_version

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_run_columns(
        sa.Column("preemptions", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("preemption_lost_s", sa.Float(), nullable=False, server_default="0"),
    )
    set_legacy_version(5)


def downgrade() -> None:
    drop_run_columns("preemption_lost_s", "preemptions")
    set_legacy_version(4)
