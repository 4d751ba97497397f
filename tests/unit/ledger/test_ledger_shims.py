"""The ledger's old module path `nightloom.ledger_model` still imports for one release: it warns, naming its new
home, and hands out the very objects of `nightloom.ledger.model`; nothing in the project imports it. The ledger's
own names still import from the package."""

from __future__ import annotations

import importlib

from tests.support.aliases import alias_users, import_alias


def test_the_old_ledger_model_module_warns_and_re_exports(monkeypatch):
    shim = import_alias("nightloom.ledger_model", "nightloom.ledger.model", monkeypatch)
    home = importlib.import_module("nightloom.ledger.model")
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(home, name), name


def test_no_project_code_imports_the_old_ledger_model_module():
    users = alias_users({"nightloom.ledger_model"})
    assert not users, "import nightloom.ledger.model:\n  " + "\n  ".join(users)


def test_the_ledger_package_keeps_its_names():
    import nightloom.ledger as ledger
    from nightloom.ledger.records import RunRecord
    from nightloom.ledger.runs import Ledger

    assert ledger.Ledger is Ledger and ledger.RunRecord is RunRecord
    assert all(getattr(ledger, n) is not None for n in ledger.__all__)
