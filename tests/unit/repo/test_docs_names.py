"""Every module, file and function docs/architecture.md names in backticks exists in the source.

The rule, for each `code span` (its first word only, so `bench/sharding.py --many-files N` is `bench/sharding.py`):

- A path (it holds a `/`, or ends in `.py`): `nightloom/train/lora.py`, `planner/`, `catalog.py`. It must be a file
  or folder under the repository root or under `nightloom/`; a bare `name.py` must be a file of that name somewhere
  in nightloom/, flows/, tasks/, bench/ or tests/. A path followed by names (`train/data.read_eval_windows`) must
  also define them (below). A span with a placeholder (`<storage.root>/<run_id>`) is not a name.
- A dotted name (`a.b`, `a.b.c`): checked when its first part is ours: `nightloom`/`flows`/`tasks`, a module or
  package whose last part is `a` (`plan` is any of the `plan.py` modules, `spec` the spec package), or a class
  named `a` (`ParallelDims.resolve`). The rest must be submodules, then names a module defines at its top level
  (def, class, assignment, or an import: a re-export counts), then names in a class's body (methods, fields) —
  for one of the candidates at least. A name whose first part is not ours (`os.read`, `pa.string`) is not
  checked, nor a file name (`manifest.json`, `mapping.bin`).
- A dotted name that is a path of spec fields (`sharding.dask`, `train.xtuner.base_model`) passes too: the docs
  write a spec field as the YAML path a user writes.

The source is read as text (ast), not imported, so the test is fast and names private helpers too (`write._runs`).
"""

from __future__ import annotations

import ast
import re
import typing
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("nightloom", "flows", "tasks")
FILE_SUFFIXES = {"json", "yaml", "yml", "bin", "idx", "parquet", "md", "txt", "csv", "jsonl", "db", "log", "png"}
FILE_SUFFIXES |= {"jinja", "toml", "cfg", "ini", "sh", "arrow", "safetensors", "pt", "ipynb", "html"}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
PATHLIKE = re.compile(r"[\w./-]+(\(\))?")


@cache
def modules() -> dict[str, ast.Module]:
    """Dotted module name -> its parsed source, for every module and package of nightloom/, flows/, tasks/."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds: defs, classes, assignments, annotated fields, imports."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names[(a.asname or a.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING imports, fallbacks
            names.update(_defined(node.body))
    return names


def _resolves(scope: str | ast.ClassDef, rest: list[str]) -> bool:
    """`rest` names, in order, from a module (its dotted name) or a class."""
    if not rest:
        return True
    head, tail = rest[0], rest[1:]
    if isinstance(scope, str):
        if f"{scope}.{head}" in modules():
            return _resolves(f"{scope}.{head}", tail)
        found = _defined(modules()[scope].body).get(head)
    else:
        found = _defined(scope.body).get(head)
    if found is None:
        return False
    if isinstance(found, ast.ClassDef):
        return _resolves(found, tail)
    return not tail


@cache
def classes() -> dict[str, list[ast.ClassDef]]:
    """Class name -> every class of that name in the source."""
    out: dict[str, list[ast.ClassDef]] = {}
    for tree in modules().values():
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                out.setdefault(n.name, []).append(n)
    return out


@cache
def file_names() -> set[str]:
    """The names of the files under nightloom/, flows/, tasks/, bench/ and tests/."""
    return {p.name for d in (*PACKAGES, "bench", "tests") for p in (ROOT / d).rglob("*") if p.is_file()}


@cache
def spec_fields() -> set[str]:
    """Every field path of the run spec (`sharding.dask`, `train.xtuner.base_model`)."""
    from pydantic import BaseModel

    from nightloom.spec import RunSpec

    def models(annotation) -> list[type[BaseModel]]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [m for arg in typing.get_args(annotation) for m in models(arg)]

    paths: set[str] = set()

    def walk(model: type[BaseModel], prefix: str, depth: int) -> None:
        for name, field in model.model_fields.items():
            name = field.alias or name  # `validate`, the YAML key of the field validate_
            paths.add(prefix + name)
            if depth < 4:
                for sub in models(field.annotation):
                    walk(sub, f"{prefix}{name}.", depth + 1)

    walk(RunSpec, "", 0)
    return paths


def _path_ok(text: str) -> bool:
    """A path, possibly followed by names: `train/data.read_eval_windows`, `flows/stages.model_shape`."""
    base = text.rstrip("/")
    if (ROOT / base).exists() or (ROOT / "nightloom" / base).exists():
        return True
    if "/" not in text:  # a bare file name
        return text in file_names()
    folder, _, dotted = text.rpartition("/")
    stem, *names = dotted.split(".")
    for prefix in ("", "nightloom/"):
        module = f"{prefix}{folder}/{stem}".replace("/", ".")
        if module in modules() and _resolves(module, names):
            return True
    return False


def _dotted_ok(text: str) -> bool | None:
    """True/False for a name that is ours; None for one that is not checked (not ours, or a file name)."""
    parts = text.removesuffix("()").split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None
    head, rest = parts[0], parts[1:]
    if head in PACKAGES:
        candidates = [(head, rest)]
    else:
        candidates = [(m, rest) for m in modules() if m.split(".")[-1] == head]
        candidates += [(c, rest) for c in classes().get(head, [])]
        if not candidates:
            return None
    return any(_resolves(scope, names) for scope, names in candidates) or text in spec_fields()


def cited_names() -> list[tuple[int, str]]:
    out = []
    for lineno, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), 1):
        for span in re.findall(r"`([^`]+)`", line):
            word = span.split()[0] if span.split() else ""
            if "<" in word or not PATHLIKE.fullmatch(word):
                continue
            if "/" in word or word.endswith(".py") or DOTTED.fullmatch(word.removesuffix("()")):
                out.append((lineno, word))
    return out


def test_the_rule_checks_names_of_every_kind():
    """The rule is not vacuous: it sees paths, module.function and class.method spans, and refuses made-up ones."""
    words = {w for _, w in cited_names()}
    assert {"nightloom/train/lora.py", "prepare.plan_job", "ParallelDims.resolve"} <= words
    assert _path_ok("hf/export.py") and not _path_ok("hf/exports.py")
    assert _dotted_ok("provision.get_provider") and not _dotted_ok("provision.no_such_provider")
    assert _dotted_ok("ParallelDims.resolve") and not _dotted_ok("ParallelDims.resolved")
    assert (
        _dotted_ok("sharding.dask")
        and _dotted_ok("validate.eval_data")
        and _dotted_ok("os.read") is None
        and _dotted_ok("manifest.json") is None
    )


def test_every_name_architecture_md_cites_exists():
    missing = []
    for lineno, word in cited_names():
        ok = _path_ok(word) if ("/" in word or word.endswith(".py")) else _dotted_ok(word)
        if ok is False:
            missing.append(f"docs/architecture.md:{lineno}: `{word}`")
    assert not missing, "names that do not exist in the source:\n" + "\n".join(missing)
