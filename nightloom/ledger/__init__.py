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

import importlib
from typing import TYPE_CHECKING

# Names load on first use (PEP 562): a training rank needs only records.py (Figure), not SQLAlchemy and Alembic,
# which cost every rank about half a second of start-up.
_HOMES = {
    "Calibration": "calibration",
    "SCHEMA_VERSION": "engine",
    "model_family": "model",
    "RUN_STATUSES": "records",
    "Figure": "records",
    "Interruption": "records",
    "LedgerError": "records",
    "NightRecord": "records",
    "RunRecord": "records",
    "RunStatus": "records",
    "Ledger": "runs",
    "calibration_for_spec": "runs",
}

if TYPE_CHECKING:
    from nightloom.ledger.calibration import Calibration
    from nightloom.ledger.engine import SCHEMA_VERSION
    from nightloom.ledger.model import model_family
    from nightloom.ledger.records import (
        RUN_STATUSES,
        Figure,
        Interruption,
        LedgerError,
        NightRecord,
        RunRecord,
        RunStatus,
    )
    from nightloom.ledger.runs import Ledger, calibration_for_spec


def __getattr__(name: str) -> object:
    """Import the module that holds `name` when it is first asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'nightloom.ledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"nightloom.ledger.{home}"), name)
    globals()[name] = value
    return value


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
