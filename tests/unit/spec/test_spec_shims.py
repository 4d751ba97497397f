"""The spec's old module paths (before nightloom/spec/ was a package) still import for one release: each warns,
naming its new home, and hands out the very objects of that home; nothing in the project imports them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.support.import_graph import build

ROOT = Path(__file__).resolve().parents[3]

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
    new = SHIMS[old]
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported before: import it afresh, so it warns again
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated .* import from {new}"):
        shim = importlib.import_module(old)
    home = importlib.import_module(new)
    assert shim.__all__
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(home, name), name


def test_the_spec_package_keeps_the_schema_names():
    import nightloom.spec as spec
    import nightloom.spec.schema as schema

    assert spec.RunSpec is schema.RunSpec and spec.SpecError is schema.SpecError
    assert all(getattr(spec, n) is not None for n in spec.__all__)


def test_no_project_code_imports_an_old_spec_module():
    graph = build(ROOT)
    users = sorted(
        f"{graph.modules[a].as_posix()}:{line} imports {b}" for (a, b), line in graph.edges.items() if b in SHIMS
    )
    assert not users, "import the new paths:\n  " + "\n  ".join(users)
    texts = [*ROOT.glob("examples/*.ipynb"), *ROOT.glob("bench/*.py"), *ROOT.glob("tests/**/*.py")]
    stale = sorted(
        str(p.relative_to(ROOT))
        for p in texts
        if p.name != Path(__file__).name and any(f"{old} import" in p.read_text() for old in SHIMS)
    )
    assert not stale, f"import the new paths in {stale}"
