"""Every XTuner test runs offline with a private HF cache (fixtures: tests/support/xtuner_fixtures.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _offline(hf_offline):
    yield
