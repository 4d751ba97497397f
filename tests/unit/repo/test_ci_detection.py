"""Tests decide "am I in CI?" in one place (tests/support/ci.py: in_ci / skip_or_fail), never by reading CI again."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
READS_CI = re.compile(r"""environ(\.get\(|\[)\s*["']CI["']|getenv\(\s*["']CI["']""")


def test_only_conftest_reads_the_ci_variable():
    readers = sorted(
        str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py") if READS_CI.search(p.read_text(encoding="utf-8"))
    )
    assert readers == ["support/ci.py"], f"use tests.support.ci.in_ci()/skip_or_fail() instead in: {readers}"


def test_skip_or_fail(monkeypatch):
    import pytest

    from tests.support.ci import in_ci, skip_or_fail

    for value, ci in [("true", True), ("1", True), ("YES", True), ("", False), ("false", False)]:
        monkeypatch.setenv("CI", value)
        assert in_ci() is ci
        with pytest.raises(pytest.fail.Exception if ci else pytest.skip.Exception, match="no widget"):
            skip_or_fail("no widget")
