"""Prefect flows: the whole run (`training_pipeline`) and its parts. Flows only orchestrate. Importing the package
changes nothing: the entry points apply Prefect's defaults themselves (flows/defaults.py)."""

from __future__ import annotations

import os
from pathlib import Path


def training_pipeline(spec, resume_run_id: str | None = None):
    """The whole run from Python (a notebook, a script): `flows.pipeline.training_pipeline`, the flow, with a
    spec file checked first, so that a wrong path or field fails at once, before a temporary server starts.

    `spec`: a path to a spec YAML (relative to the current folder) or a `nightloom.spec.RunSpec`. Returns the
    run's `nightloom.report.RunSummary` (a table with the loss curve in Jupyter)."""
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(
                f"spec file {str(spec)!r} not found: no file {path.absolute()} (current folder {Path.cwd()})"
            )
        from nightloom.spec.load import load_spec

        check_data(load_spec(path))  # every field error at once (SpecError), bad records, before Prefect starts
        spec = str(spec)
    from flows.defaults import set_prefect_defaults

    set_prefect_defaults()  # before Prefect's first import (flows.pipeline): its console handler, its server
    from flows.pipeline import training_pipeline as flow

    return flow(spec, resume_run_id=resume_run_id)


def check_data(spec) -> None:
    """The pre-scan of the spec's local data (nightloom.sharding.prescan): BadInputError with its report (one line
    per bad record, the count, the fix) when it finds bad records or unreadable input."""
    from nightloom.sharding.errors import BadInputError
    from nightloom.sharding.prescan import prescan_spec

    found = prescan_spec(spec)
    if found is not None and not found.ok:
        raise BadInputError(found.report())


__all__ = ["training_pipeline"]
