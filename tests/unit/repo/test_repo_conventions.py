"""Repository conventions: `datasets` is Hugging Face's, module and function sizes, the docs a clone holds, the venv
recipe. The import graph (no cycles, imports point down) is tests/unit/repo/test_import_graph.py."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_datasets_is_hugging_face_from_repo_root():
    code = "import importlib.util, sys; print(importlib.util.find_spec('datasets').origin)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "site-packages" in r.stdout, r.stdout
    assert not (ROOT / "datasets" / "__init__.py").exists()
    assert not list((ROOT / "datasets").rglob("*.py")), "datasets/ is data only"
    assert "site-packages" in importlib.util.find_spec("datasets").origin


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


def _imported_modules(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every absolute import in a file (`from x import y` gives `x`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def test_bench_never_imports_tests():
    """Benchmarks are standalone scripts: what they share with tests lives in nightloom/ or bench/_support.py."""
    files = list((ROOT / "bench").rglob("*.py"))
    assert files
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {mod}"
        for path in files
        for mod, line in _imported_modules(path)
        if mod == "tests" or mod.startswith("tests.")
    ]
    assert not offenders, offenders


#: issue 14: every task and the flow modules read in one sitting; the run itself fits one screen
MAX_FUNCTION_LINES = 60
MAX_FLOW_BODY_LINES = 45


def _functions(path: Path):
    """(name, first line, lines from `def` to the end, body lines after the docstring) of every function."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1, node.end_lineno - body[0].lineno + 1


def test_no_long_function_in_tasks_or_flows():
    files = [*(ROOT / "tasks").rglob("*.py"), ROOT / "flows" / "pipeline.py", ROOT / "flows" / "shard.py"]
    long = [
        f"{path.relative_to(ROOT)}:{line} {name}: {total} lines"
        for path in files
        for name, line, total, _ in _functions(path)
        if total > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


#: issue 51: a function is one job, read without scrolling back; past 80 lines it is several named steps in one
MAX_LIBRARY_FUNCTION_LINES = 80


def test_no_function_over_80_lines():
    """Every function in nightloom/, tasks/ and flows/, counted from its `def` to its last line (decorators
    excluded), is at most 80 lines; each offender is named file:line name length."""
    long = [
        f"{path.relative_to(ROOT)}:{line} {name} {total}"
        for top in ("nightloom", "tasks", "flows")
        for path in sorted((ROOT / top).rglob("*.py"))
        for name, line, total, _ in _functions(path)
        if total > MAX_LIBRARY_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_LIBRARY_FUNCTION_LINES} lines: {long}"


def test_the_run_flow_fits_one_screen():
    found = {name: body for name, _, _, body in _functions(ROOT / "flows" / "pipeline.py")}
    assert "training_pipeline" in found
    assert found["training_pipeline"] <= MAX_FLOW_BODY_LINES, found["training_pipeline"]


def test_the_makefile_installs_the_pinned_torch_and_uv():
    """The venv recipe installs torch and uv by hand (before uv resolves the rest): the same pins as pyproject."""
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = dict(d.split("==", 1) for d in deps if "==" in d)
    recipe = (ROOT / "Makefile").read_text()
    for name in ("torch", "uv"):
        found = set(re.findall(rf"\b{name}==([\w.+]+)", recipe))
        assert found == {pins[name]}, f"Makefile pins {name} {found}, pyproject {pins[name]}"


@pytest.mark.slow
def test_every_library_a_training_rank_imports_is_byte_compiled():
    """`make venv` byte-compiles all of site-packages, including what pip installed (torch and its dependencies:
    uv compiles only its own). Without a .pyc, and with PYTHONDONTWRITEBYTECODE=1 (set on CI machines), every
    rank compiled torch and sympy again on import: 3.6 instead of 1.75 CPU-s, the whole test suite at half speed."""
    import site

    code = (
        "import importlib.util, os, sys, sysconfig, nightloom.train.trainer\n"
        "lib = sysconfig.get_paths()['purelib']\n"
        "files = [m.__file__ for m in list(sys.modules.values()) if (getattr(m, '__file__', None) or '')"
        ".startswith(lib) and m.__file__.endswith('.py')]\n"
        "missing = sorted({os.path.relpath(f, lib).split(os.sep)[0] for f in files"
        " if not os.path.exists(importlib.util.cache_from_source(f))})\n"
        "print(len(files), missing)\n"
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    count, missing = r.stdout.split(" ", 1)
    assert int(count) > 500, r.stdout  # torch alone brings ~1,000 modules: the check looked at the right folder
    assert ast.literal_eval(missing) == [], (
        f"no .pyc for modules of {missing} (under {site.getsitepackages()}): rebuild with `make venv`"
    )


@pytest.mark.slow
def test_a_training_rank_reads_manifests_without_importing_the_sharder():
    """`nightloom.sharding` exports its names lazily: a rank's data module (which reads manifest.json) imports
    neither pyarrow nor the sharder, ~0.6 s of every rank's start-up; the package's names still resolve."""
    code = (
        "import sys, nightloom.train.data, nightloom.sharding as s\n"
        "heavy = sorted(m for m in sys.modules if m == 'pyarrow' or m.startswith('nightloom.sharding.'))\n"
        "print(heavy)\n"
        "assert s.shard_dataset.__module__ == 'nightloom.sharding.pipeline' and 'pyarrow' in sys.modules\n"
        "assert sorted(s.__all__) == sorted(s._EXPORTS) and all(getattr(s, n) for n in s.__all__)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    assert ast.literal_eval(r.stdout.strip()) == ["nightloom.sharding.manifest"], r.stdout


MAX_MODULE_LINES = 650


def test_no_module_over_650_lines():
    """A module holds one job: past 650 lines it holds several (split along the seams it already has)."""
    big = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for top in ("nightloom", "tasks", "flows", "deployments")
        for p in sorted((ROOT / top).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_nothing_cites_the_first_design_note():
    """docs/architecture.md is the living design; the first design note is not in a user's clone."""
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    if not tracked:  # not a git checkout (an sdist): read the tree instead
        tracked = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    needle = "DESIGN" + ".md"
    cites = []
    for rel in tracked:
        p = ROOT / rel
        if p.suffix in (".py", ".md", ".yaml", ".yml", ".toml", ".ipynb", ".txt", ".tmpl", ".sh", "") and p.is_file():
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if needle in line:
                    cites.append(f"{rel}:{n}")
    assert not cites, f"cites {needle}: {cites}"


def test_readme_is_a_short_guide_that_links_the_architecture_early():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (a guide: at most 250; reference goes to docs/)"
    assert any("docs/architecture.md" in line for line in lines[:40]), "link docs/architecture.md in the first 40 lines"
    for target in sorted({m for line in lines for m in _md_links(line)}):
        assert (ROOT / target).exists(), f"README.md links {target}, which does not exist"


def _md_links(line: str) -> list[str]:
    """Relative link targets of a Markdown line (no URLs, no anchors)."""
    import re

    return [m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", line) if "://" not in m and not m.startswith("#")]
