"""The import graph of nightloom/, tasks/, flows/ and deployments/, built from the source: no cycle anywhere
(function-level imports count), and every import points down the floors (docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

from tests.support.import_graph import build, floor_violations

ROOT = Path(__file__).resolve().parents[3]


def test_no_import_cycle_in_the_project():
    graph = build(ROOT)
    assert len(graph.modules) > 100 and len(graph.edges) > 300  # it read the real tree
    cycles = graph.cycles()
    assert not cycles, "import cycles:\n  " + "\n  ".join(graph.describe_cycle(c) for c in cycles)


def test_imports_point_down_the_floors():
    problems = floor_violations(build(ROOT))
    assert not problems, "imports that point up:\n  " + "\n  ".join(problems)


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_two_planted_modules_that_import_each_other_are_named(tmp_path):
    """The guard fails on a cycle, however it is hidden: here one side imports inside a function."""
    _plant(
        tmp_path,
        {
            "nightloom/__init__.py": "",
            "nightloom/alpha.py": "from nightloom.beta import b\n\ndef a():\n    return b()\n",
            "nightloom/beta.py": "def b():\n    from nightloom import alpha\n\n    return alpha\n",
            "nightloom/gamma.py": "import nightloom.alpha\n",
        },
    )
    graph = build(tmp_path)
    assert graph.cycles() == [["nightloom.alpha", "nightloom.beta"]]
    text = graph.describe_cycle(graph.cycles()[0])
    assert "nightloom.alpha (nightloom/alpha.py:1) -> nightloom.beta (nightloom/beta.py:2) -> nightloom.alpha" == text


def test_relative_imports_and_package_inits_count(tmp_path):
    _plant(
        tmp_path,
        {
            "nightloom/__init__.py": "",
            "nightloom/pkg/__init__.py": "from .inner import x\n",
            "nightloom/pkg/inner.py": "from nightloom.pkg import other\nx = 1\n",
            "nightloom/pkg/other.py": "from .. import pkg\n",
        },
    )
    assert build(tmp_path).cycles() == [["nightloom.pkg", "nightloom.pkg.inner", "nightloom.pkg.other"]]


def test_an_upward_import_is_named_with_its_line(tmp_path):
    _plant(
        tmp_path,
        {
            "nightloom/__init__.py": "",
            "nightloom/logic.py": "import os\n\n\ndef f():\n    from prefect import flow\n",
            "nightloom/spec.py": "from nightloom.logic import f\n",
            "tasks/__init__.py": "",
            "tasks/t.py": "from flows.pipeline import run\n",
            "flows/__init__.py": "",
            "flows/pipeline.py": "from tasks.t import *\nrun = 1\n",
        },
    )
    problems = floor_violations(build(tmp_path))
    assert problems == [
        "nightloom/logic.py:5: nightloom.logic imports prefect (nightloom/ must not import prefect)",
        "tasks/t.py:1: tasks.t imports flows.pipeline (tasks/ must not import flows)",
        "nightloom/spec.py:1: nightloom.spec is a leaf but imports nightloom.logic",
    ]


def test_a_module_that_imports_from_a_higher_floor_is_named(tmp_path):
    """The planner (floor 2) must not reach into the trainer (floor 3); a new room must choose its floor."""
    _plant(
        tmp_path,
        {
            "nightloom/__init__.py": "",
            "nightloom/planner/__init__.py": "",
            "nightloom/planner/search.py": "from nightloom.train.model import build\n",
            "nightloom/train/__init__.py": "",
            "nightloom/train/model.py": "from nightloom.planner import search\nbuild = 1\n",
            "nightloom/newroom.py": "from nightloom import shape\n",
            "nightloom/shape.py": "",
        },
    )
    graph = build(tmp_path)
    assert floor_violations(graph) == [
        "nightloom/newroom.py: nightloom.newroom has no floor (add it to FLOORS in tests.support.import_graph)",
        "nightloom/planner/search.py:1: nightloom.planner.search (floor 2) imports nightloom.train.model (floor 3)",
    ]
