"""The project's import graph, built from the source (ast, nothing imported): modules, edges and cycles.

Every import counts, function-level ones included: a cycle hidden inside a function is still a cycle in the
design. `from pkg import name` depends on `pkg` (its __init__ runs) and on `pkg.name` when that is a module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("nightloom", "tasks", "flows", "deployments")


@dataclass
class ImportGraph:
    """Modules (dotted name -> file) and the edges between them, with the line of each import."""

    modules: dict[str, Path]
    edges: dict[tuple[str, str], int] = field(default_factory=dict)  # (importer, imported) -> first line
    external: dict[tuple[str, str], int] = field(default_factory=dict)  # (importer, top-level package) -> line

    def imports_of(self, module: str) -> set[str]:
        return {b for a, b in self.edges if a == module}

    def cycles(self) -> list[list[str]]:
        """Every strongly connected component of more than one module (Tarjan), each sorted, smallest first."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        out: list[list[str]] = []
        succ: dict[str, list[str]] = {m: [] for m in self.modules}
        for a, b in self.edges:
            succ[a].append(b)

        def visit(v: str) -> None:  # recursion depth is bounded by the module count (~150)
            index[v] = low[v] = len(index)
            stack.append(v)
            on_stack.add(v)
            for w in sorted(succ[v]):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

        for m in sorted(self.modules):
            if m not in index:
                visit(m)
        return sorted(out)

    def describe_cycle(self, cycle: list[str]) -> str:
        """`a (file:line) -> b -> ... -> a`: one path around the cycle, each edge with the line that makes it."""
        members = set(cycle)
        start, path = cycle[0], [cycle[0]]
        seen = {start}
        node = start
        while True:
            nxt = sorted(b for a, b in self.edges if a == node and b in members)
            step = next((b for b in nxt if b == start and len(path) > 1), None) or next(
                (b for b in nxt if b not in seen), nxt[0]
            )
            path.append(step)
            if step in seen:
                break
            seen.add(step)
            node = step
        hops = [
            f"{a} ({self.modules[a].as_posix()}:{self.edges[(a, b)]})" for a, b in zip(path, path[1:], strict=False)
        ]
        return " -> ".join(hops + [path[-1]])


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _absolute(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def build(root: Path, packages: Iterable[str] = PACKAGES) -> ImportGraph:
    """The import graph of `packages` under `root` (paths in the graph are relative to root)."""
    files = {_module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph = ImportGraph({m: p.relative_to(root) for m, p in files.items()})
    for importer, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(importer, is_package, node.module, node.level)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                known = next(
                    (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in files), None
                )
                if known is None:
                    graph.external.setdefault((importer, parts[0]), node.lineno)
                elif known != importer:
                    graph.edges.setdefault((importer, known), node.lineno)
    return graph


#: What each layer may not import (docs/architecture.md, "Floors"): imports point down, flows -> tasks -> nightloom.
FORBIDDEN = {
    "nightloom": ("prefect", "prefect_dask", "tasks", "flows", "deployments"),
    "tasks": ("flows",),
}
#: Modules that are leaves of nightloom: they import nothing of nightloom beyond what is listed.
LEAVES = {
    # the package (its namespace is the schema's) and the schema: any floor-0 section module of the package
    # (cluster, gates, operations, and the sections added beside them), never load, checks or doc (floor 2)
    "nightloom.spec": {"nightloom.spec.*"},
    "nightloom.spec.schema": {"nightloom.spec.*"},
    "nightloom.spec.base": set(),
    "nightloom.spec.cluster": {"nightloom.spec.base"},
    "nightloom.shape": set(),
    "nightloom.spec.micro_batch": set(),
    "nightloom.spec.stage_list": set(),
}


#: The floors of nightloom/ (docs/architecture.md): a module imports only from its own floor or below. A module
#: takes the floor of its longest listed prefix; one not listed is an error (a new room must choose its floor).
FLOORS = {
    "nightloom.finetune": 4,
    "nightloom.train": 3,
    "nightloom.provision": 3,
    "nightloom.schedule": 3,
    "nightloom.recovery": 3,
    "nightloom.attempt": 3,
    "nightloom.gates": 3,  # the run's gates (MFU, convergence, held-out loss)
    "nightloom.validate": 3,  # the deprecated alias of nightloom.gates (one release)
    "nightloom.ledger": 3,
    "nightloom.ledger_model": 3,  # the deprecated alias of nightloom.ledger.model (one release)
    "nightloom.queue": 3,  # the night queue: its job record, timetable, nights, chart and store
    "nightloom.queue_store": 3,  # the deprecated alias of nightloom.queue.store (one release)
    "nightloom.report": 3,
    "nightloom.track": 3,  # experiment trackers: a step sink per tracker (under train's reporter), the run's end
    "nightloom.benchmarks": 3,  # lm-evaluation-harness on a run's export and its base; completions side by side
    "nightloom.benchmarks.catalog": 2,  # lm-eval's task index, read by the spec checks (no model)
    "nightloom.benchmarks.task_index": 2,  # that index, its built-in part kept per lm-eval install
    "nightloom.plots": 3,
    "nightloom.metrics": 3,
    "nightloom.hf.load": 3,
    "nightloom.hf.export": 3,
    "nightloom.hf.random_model": 3,
    "nightloom.spec.load": 2,
    "nightloom.spec.checks": 2,
    "nightloom.rewards": 2,  # reward functions resolved without torch: spec.checks refuses them at validate
    "nightloom.spec.doc": 2,
    "nightloom.spec_load": 2,  # the deprecated aliases of the spec's old paths (one release)
    "nightloom.spec_checks": 2,
    "nightloom.spec_doc": 2,
    "nightloom.model_resolver": 2,
    "nightloom.planner": 2,
    "nightloom.sharding": 2,
    "nightloom.tokenizer": 2,
    "nightloom.chat": 2,
    "nightloom.chat_pairs": 2,
    "nightloom.hf": 2,
    "nightloom.catalog": 1,
    "nightloom.hf.config": 1,
    "nightloom.families": 1,  # the model-family registry and its units (no torch at import)
    "nightloom.parallel": 1,
    "nightloom.perf": 1,
    "nightloom.storage": 1,
    "nightloom.model_cache": 1,
    "nightloom": 0,
    "nightloom.spec": 0,
    "nightloom.shape": 0,
    "nightloom.spec.micro_batch": 0,
    "nightloom.spec.stage_list": 0,
    "nightloom.spec.base": 0,
    "nightloom.spec.cluster": 0,
    "nightloom.spec.schema": 0,
    "nightloom.micro_batch": 0,  # deprecated aliases (one release)
    "nightloom.stage_list": 0,
    "nightloom.spec_base": 0,
    "nightloom.spec_cluster": 0,
    "nightloom.xtuner_families": 1,
    "nightloom.runfiles": 0,
    "nightloom.records": 0,  # the base of the typed records (pydantic, extra fields refused)
    "nightloom.util": 0,
    "nightloom.node_reply": 0,  # the line a node-side program prints for the orchestrator (stdlib only)
}


def floor_of(module: str, floors: dict[str, int] = FLOORS) -> int | None:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in floors and (i == len(parts) or ".".join(parts[:i]) != "nightloom"):
            return floors[".".join(parts[:i])]
    return None


def floor_violations(graph: ImportGraph) -> list[str]:
    """`file:line: importer imports X` for every import that points up (or out of nightloom into Prefect)."""
    out = []
    for (a, b), line in sorted({**graph.edges, **graph.external}.items()):
        layer, target = a.split(".")[0], b.split(".")[0]
        if target in FORBIDDEN.get(layer, ()):
            out.append(f"{graph.modules[a].as_posix()}:{line}: {a} imports {b} ({layer}/ must not import {target})")
    for (a, b), line in sorted(graph.edges.items()):
        if not (a.startswith("nightloom") and b.startswith("nightloom")):
            continue
        fa, fb = floor_of(a), floor_of(b)
        if fa is None:
            if any(o.startswith(f"{graph.modules[a].as_posix()}: ") for o in out):
                continue  # named once
            out.append(f"{graph.modules[a].as_posix()}: {a} has no floor (add it to FLOORS in {__name__})")
        elif fb is not None and fb > fa:
            out.append(f"{graph.modules[a].as_posix()}:{line}: {a} (floor {fa}) imports {b} (floor {fb})")
    for leaf, allowed in LEAVES.items():
        for b in sorted(graph.imports_of(leaf) - allowed):
            spec_leaf = "nightloom.spec.*" in allowed and b.startswith("nightloom.spec.") and floor_of(b) == 0
            if leaf in graph.modules and b.startswith("nightloom") and not spec_leaf:
                line = graph.edges[(leaf, b)]
                out.append(f"{graph.modules[leaf].as_posix()}:{line}: {leaf} is a leaf but imports {b}")
    return out
