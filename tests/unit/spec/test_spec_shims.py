"""The spec's old module paths (before nightloom/spec/ was a package) still import for one release: each warns,
naming its new home, and hands out the very objects of that home; nothing in the project imports them."""

from __future__ import annotations

import importlib

import pytest

from tests.support.aliases import alias_users, import_alias

#: old module -> its new home
SHIMS = {
    "nightloom.spec_load": "nightloom.spec.load",
    "nightloom.spec_checks": "nightloom.spec.checks",
    "nightloom.spec_doc": "nightloom.spec.doc",
    "nightloom.spec_base": "nightloom.spec.base",
    "nightloom.spec_cluster": "nightloom.spec.cluster",
    "nightloom.stage_list": "nightloom.spec.stage_list",
    "nightloom.micro_batch": "nightloom.spec.micro_batch",
}


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_an_old_spec_module_warns_and_re_exports(old, monkeypatch):
    shim = import_alias(old, SHIMS[old], monkeypatch)
    home = importlib.import_module(SHIMS[old])
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(home, name), name


def test_the_spec_package_keeps_the_schema_names():
    import nightloom.spec as spec
    import nightloom.spec.schema as schema

    assert spec.RunSpec is schema.RunSpec and spec.SpecError is schema.SpecError
    assert all(getattr(spec, n) is not None for n in spec.__all__)


def test_no_project_code_imports_an_old_spec_module():
    users = alias_users(set(SHIMS))
    assert not users, "import the new paths:\n  " + "\n  ".join(users)
