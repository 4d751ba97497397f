"""Old module paths kept one release as deprecated aliases: each warns naming its new home and hands out that
home's very objects; no project code (nor the notebook, bench or another test) imports one."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.import_graph import build

ROOT = Path(__file__).resolve().parents[2]


def import_alias(old: str, new: str, monkeypatch) -> ModuleType:
    """`old` imported afresh (an earlier import would not warn again), warning that it goes and that `new` is
    where to import from; its `__all__` is not empty."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated .* import from {new}"):
        shim = importlib.import_module(old)
    assert shim.__all__
    return shim


def alias_users(olds) -> list[str]:
    """Where the project still uses one of the `olds`: 'file:line imports X' from the import graph (the aliases
    themselves aside), then the notebooks, bench and tests (these alias tests aside) that name one in an import."""
    graph = build(ROOT)
    users = [
        f"{graph.modules[a].as_posix()}:{line} imports {b}"
        for (a, b), line in graph.edges.items()
        if b in olds and a not in olds
    ]
    texts = [*ROOT.glob("examples/*.ipynb"), *ROOT.glob("bench/*.py"), *ROOT.glob("tests/**/*.py")]
    for p in texts:
        if p.name.endswith(("_shims.py", "_shim.py")) or p.name == "aliases.py":
            continue
        text = p.read_text(encoding="utf-8")
        users += [f"{p.relative_to(ROOT)} imports {old}" for old in olds if f"{old} import" in text]
    return sorted(users)
