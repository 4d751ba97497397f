"""One Prefect backend per test session: the CI server when PREFECT_API_URL is set, else a test harness."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def prefect_backend(tmp_path_factory):
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    os.environ.setdefault("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-home")))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        from prefect.settings import PREFECT_API_URL

        yield PREFECT_API_URL.value()
