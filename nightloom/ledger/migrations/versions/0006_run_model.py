"""Schema 6: the `family` of the model each run trained (the calibration's key) beside its `model`, and rows written
before corrected: a run whose model came from model.config or model.weights was recorded under the spec's default
catalog name (`tiny`). Where the row's run folder (the folder of its metrics_path) still holds a job*.json, the
model resolved there names the row's model and family (nightloom.ledger.model.run_model_from_job); any other row
keeps its model, with the family of its name (`llama2-70b` → `llama2`). Offline (`--sql`) only the column is added
(rows then read the family of their model's name).

Revision ID: 0006
Revises: 0005
"""

from pathlib import Path

import sqlalchemy as sa
from alembic import op

from nightloom.ledger.migrations import add_run_columns, drop_run_columns, set_legacy_version
from nightloom.ledger.model import model_family, run_model_from_job

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

RUNS = sa.table(
    "nightloom_runs", sa.column("run_id"), sa.column("model"), sa.column("family"), sa.column("metrics_path")
)


def _correct_rows(conn: sa.Connection) -> None:
    """Every row's model and family from its run folder's job file where one is left, else its name's family."""
    rows = conn.execute(sa.select(RUNS.c.run_id, RUNS.c.model, RUNS.c.metrics_path)).all()
    for run_id, model, metrics_path in rows:
        found = run_model_from_job(Path(metrics_path).parent) if metrics_path else None
        fields = {"model": found.name, "family": found.family} if found else {"family": model_family(model)}
        conn.execute(RUNS.update().where(RUNS.c.run_id == run_id).values(**fields))


def upgrade() -> None:
    add_run_columns(sa.Column("family", sa.String(64), nullable=False, server_default=""))
    if not op.get_context().as_sql:
        _correct_rows(op.get_bind())
    set_legacy_version(6)


def downgrade() -> None:
    """Drop the family; corrected model names stay (the name they replaced was wrong)."""
    drop_run_columns("family")
    set_legacy_version(5)
