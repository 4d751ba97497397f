"""The run ledger: one row per run (layout, predicted vs measured MFU, times, cost, verdicts, nights), any
SQLAlchemy URL; `from nightloom.ledger import Ledger, RunRecord, ...`. Its modules, one job each:

- records.py: the typed records (RunRecord, Figure, Interruption, NightRecord) and LedgerError;
- model.py: the model and family a row names (the model the run trained, not the spec's catalog name);
- engine.py: the runs table, opening an engine, the Alembic bootstrap (migrations/) and SQLite's retries;
- runs.py: `Ledger`, the writes and queries, and `calibration_for_spec`;
- calibration.py: measured/predicted MFU of verified runs, the planner's efficiency factor;
- export.py: the runs as CSV.
"""

from __future__ import annotations

from nightloom.ledger.calibration import Calibration
from nightloom.ledger.engine import SCHEMA_VERSION
from nightloom.ledger.model import model_family
from nightloom.ledger.records import RUN_STATUSES, Figure, Interruption, LedgerError, NightRecord, RunRecord, RunStatus
from nightloom.ledger.runs import Ledger, calibration_for_spec

__all__ = [
    "RUN_STATUSES",
    "SCHEMA_VERSION",
    "Calibration",
    "Figure",
    "Interruption",
    "Ledger",
    "LedgerError",
    "NightRecord",
    "RunRecord",
    "RunStatus",
    "calibration_for_spec",
    "model_family",
]
