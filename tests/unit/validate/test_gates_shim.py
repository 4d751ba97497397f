"""The gates' old module path `nightloom.validate` still imports for one release: it warns, naming its new home
`nightloom.gates`, and hands out the very objects of it; nothing in the project imports it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.support.import_graph import build

ROOT = Path(__file__).resolve().parents[3]


def test_the_old_validate_module_warns_and_re_exports(monkeypatch):
    monkeypatch.delitem(sys.modules, "nightloom.validate", raising=False)  # import it afresh, so it warns again
    with pytest.warns(DeprecationWarning, match="nightloom.validate is deprecated .* nightloom.gates"):
        shim = importlib.import_module("nightloom.validate")
    home = importlib.import_module("nightloom.gates")
    assert "Verdict" in shim.__all__ and "validate_run" in shim.__all__
    public = {
        n for n in vars(home) if not n.startswith("_") and getattr(getattr(home, n), "__module__", "") == home.__name__
    }
    assert public <= set(shim.__all__), sorted(public - set(shim.__all__))
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(home, name), name


def test_no_project_code_imports_the_old_validate_module():
    graph = build(ROOT)
    users = sorted(graph.modules[a].as_posix() for (a, b) in graph.edges if b == "nightloom.validate")
    assert not users, f"import nightloom.gates in {users}"
