"""Repository guards: `datasets` is Hugging Face's, and nightloom/ never imports Prefect."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_datasets_is_hugging_face_from_repo_root():
    code = "import importlib.util, sys; print(importlib.util.find_spec('datasets').origin)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "site-packages" in r.stdout, r.stdout
    assert not (ROOT / "datasets" / "__init__.py").exists()
    assert not list((ROOT / "datasets").rglob("*.py")), "datasets/ is data only"
    assert "site-packages" in importlib.util.find_spec("datasets").origin


def test_nightloom_never_imports_prefect():
    offenders = []
    for path in (ROOT / "nightloom").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(
                n == "prefect" or n.startswith(("prefect.", "prefect_")) or n.startswith(("flows", "tasks"))
                for n in names
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_no_module_shadows_a_third_party_package():
    """No module or package of ours is named after a package we or the node environments import."""
    shadows = {
        "datasets",
        "torch",
        "prefect",
        "xtuner",
        "boto3",
        "yaml",
        "pydantic",
        "transformers",
        "mmengine",
        "peft",
        "deepspeed",
        "asyncssh",
        "kubernetes",
        "pyarrow",
        "xxhash",
        "sqlalchemy",
        "rich",
    }
    for top in ("nightloom", "flows", "tasks"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("").parts
            assert not shadows & set(rel), f"{path.relative_to(ROOT)} is named after a third-party package"
