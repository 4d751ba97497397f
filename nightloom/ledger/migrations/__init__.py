"""Alembic migrations of the run ledger's schema; `nightloom.ledger.Ledger` runs them on the ledger's own connection.

Revision ids are the schema version as four digits (0001 = schema 1, 0002 = schema 2 ...). A schema change is a new
file in versions/ whose `down_revision` is the previous head, a bump of `nightloom.ledger.engine.SCHEMA_VERSION`,
and a test that opens a ledger written before the change. Each revision also writes its number into the legacy
`nightloom_schema` row, so a nightloom from before Alembic refuses a ledger newer than it instead of using it.
"""

from pathlib import Path

import sqlalchemy as sa
from alembic import op

SCRIPT_DIR = Path(__file__).resolve().parent
VERSION_TABLE = "nightloom_alembic_version"  # not `alembic_version`: the ledger may share a database with other apps
LEGACY_TABLE = "nightloom_schema"  # the integer version nightloom kept before Alembic (schemas 1 and 2)
RUNS_TABLE = "nightloom_runs"


def set_legacy_version(version: int) -> None:
    """Write `version` into the legacy `nightloom_schema` row: a revision's last step (upgrade and downgrade)."""
    op.execute(sa.text(f"UPDATE {LEGACY_TABLE} SET version = {version} WHERE id = 1"))


def add_run_columns(*columns: sa.Column) -> None:
    """Add `columns` to the runs table, in that order, in one batch (SQLite alters by copying when it must)."""
    with op.batch_alter_table(RUNS_TABLE) as batch:
        for column in columns:
            batch.add_column(column)


def drop_run_columns(*names: str) -> None:
    """Drop the runs table's columns `names`, in that order, in one batch: a downgrade's undoing of add_run_columns."""
    with op.batch_alter_table(RUNS_TABLE) as batch:
        for name in names:
            batch.drop_column(name)
