"""The real PostgreSQL CI starts (.ci/services.sh, NIGHTLOOM_TEST_POSTGRES_URL): a fresh database per test, and the
`ledger_url` fixture that runs a ledger test once on SQLite and once on PostgreSQL."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.support.ci import skip_or_fail

BACKENDS = ("sqlite", "postgresql")


def postgres_url() -> str:
    """The CI server's URL (its tests' database); skips outside CI without one, fails in CI."""
    url = os.environ.get("NIGHTLOOM_TEST_POSTGRES_URL")
    if not url:
        skip_or_fail("no PostgreSQL: NIGHTLOOM_TEST_POSTGRES_URL is not set (.ci/services.sh starts one)")
    return url


@contextmanager
def fresh_database(base_url: str) -> Iterator[str]:
    """A new, empty database on `base_url`'s server (its user may create databases), dropped afterwards, whatever
    connections are still open to it."""
    name = f"nl_{secrets.token_hex(6)}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(base_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def backend_url(backend: str, folder: Path) -> Iterator[str]:
    """A new ledger URL on `backend`: a SQLite file under `folder` (in a folder not made yet), or a fresh database."""
    if backend == "sqlite":
        yield f"sqlite:///{folder / 'sub' / 'ledger.db'}"
        return
    with fresh_database(postgres_url()) as url:
        yield url


@pytest.fixture(params=BACKENDS)
def ledger_url(request, tmp_path: Path) -> Iterator[str]:
    """An empty ledger's URL, once per backend (the test's id says which): SQLite, then PostgreSQL."""
    yield from backend_url(request.param, tmp_path)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database's URL (for tests that are about PostgreSQL only)."""
    with fresh_database(postgres_url()) as url:
        yield url
