"""The ledger's old module path `nightloom.ledger_model` still imports for one release: it warns, naming its new
home, and hands out the very objects of `nightloom.ledger.model`; nothing in the project imports it. The ledger's
own names still import from the package."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.support.import_graph import build

ROOT = Path(__file__).resolve().parents[3]


def test_the_old_ledger_model_module_warns_and_re_exports(monkeypatch):
    monkeypatch.delitem(sys.modules, "nightloom.ledger_model", raising=False)  # import it afresh, so it warns again
    with pytest.warns(DeprecationWarning, match="nightloom.ledger_model is deprecated .* nightloom.ledger.model"):
        shim = importlib.import_module("nightloom.ledger_model")
    home = importlib.import_module("nightloom.ledger.model")
    assert shim.__all__
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(home, name), name


def test_no_project_code_imports_the_old_ledger_model_module():
    graph = build(ROOT)
    users = sorted(graph.modules[a].as_posix() for (a, b) in graph.edges if b == "nightloom.ledger_model")
    assert not users, f"import nightloom.ledger.model in {users}"


def test_the_ledger_package_keeps_its_names():
    import nightloom.ledger as ledger
    from nightloom.ledger.records import RunRecord
    from nightloom.ledger.runs import Ledger

    assert ledger.Ledger is Ledger and ledger.RunRecord is RunRecord
    assert all(getattr(ledger, n) is not None for n in ledger.__all__)
