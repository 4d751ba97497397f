"""The real Slurm CI starts (slurmctld + slurmd n1, n2): the `slurm` fixture."""

from __future__ import annotations

import os

import pytest

from tests.support.ci import require_binary, skip_or_fail


@pytest.fixture(scope="module")
def slurm():
    require_binary("slurmctld")
    if not os.environ.get("SLURM_CONF"):
        msg = "SLURM_CONF not set: run `.ci/services.sh start` and eval `.ci/services.sh env`"
        skip_or_fail(msg)
