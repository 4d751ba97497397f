"""The gates' old module path `nightloom.validate` still imports for one release: it warns, naming its new home
`nightloom.gates`, and hands out the very objects of it; nothing in the project imports it."""

from __future__ import annotations

import importlib

from tests.support.aliases import alias_users, import_alias


def test_the_old_validate_module_warns_and_re_exports(monkeypatch):
    shim = import_alias("nightloom.validate", "nightloom.gates", monkeypatch)
    home = importlib.import_module("nightloom.gates")
    public = {
        n for n, v in vars(home).items() if not n.startswith("_") and getattr(v, "__module__", "") == home.__name__
    }
    assert {"Verdict", "validate_run"} <= public <= set(shim.__all__), sorted(public - set(shim.__all__))
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(home, name), name


def test_no_project_code_imports_the_old_validate_module():
    users = alias_users({"nightloom.validate"})
    assert not users, "import nightloom.gates:\n  " + "\n  ".join(users)
