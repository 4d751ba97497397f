"""No module of nightloom/, tasks/ or flows/ imports another module's private names (`from m import _name`): a
name two modules share is public where it belongs (docs/architecture.md, "Floors")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("nightloom", "tasks", "flows")


def _module(root: Path, path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def _target(importer: str, package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """`file:line: importer imports _name from module` for each private name taken from another project module."""
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            importer, package = _module(root, path)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
                if isinstance(node, ast.Import):
                    pairs = [(a.name.rpartition(".")[0], a.name.rpartition(".")[2]) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    pairs = [(_target(importer, package, node), a.name) for a in node.names]
                else:
                    continue
                for source, name in pairs:
                    own = source.split(".")[0] in packages and source != importer
                    if own and name.startswith("_") and not name.startswith("__"):
                        rel = path.relative_to(root).as_posix()
                        out.append(f"{rel}:{node.lineno}: {importer} imports {name} from {source}")
    return out


def test_no_module_imports_another_modules_private_names():
    assert len(list((ROOT / "nightloom").rglob("*.py"))) > 100  # it read the real tree
    found = private_imports(ROOT)
    assert not found, "make the shared name public where it belongs:\n  " + "\n  ".join(found)


def test_a_planted_private_import_is_named_wherever_it_hides(tmp_path):
    """Absolute, relative and function-level imports of a private name are found; a module's own names and dunders
    are not."""
    files = {
        "nightloom/__init__.py": "",
        "nightloom/a.py": "_x = 1\n__version__ = '1'\n",
        "nightloom/b.py": "from nightloom import __version__\n\ndef f():\n    from nightloom.a import _x\n",
        "nightloom/c/__init__.py": "from .d import _y\n",
        "nightloom/c/d.py": "_y = 2\nfrom nightloom.c.d import _y as own\n",
        "tasks/t.py": "from nightloom.a import public, _x\n",
        "flows/f.py": "import json\nfrom json import _default_decoder\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert private_imports(tmp_path) == [
        "nightloom/b.py:4: nightloom.b imports _x from nightloom.a",
        "nightloom/c/__init__.py:1: nightloom.c imports _y from nightloom.c.d",
        "tasks/t.py:1: tasks.t imports _x from nightloom.a",
    ]
