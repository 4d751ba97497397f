"""lm-eval's task index as validate reads it: each task, group and tag name with its kind, tags and the few config
keys the data check reads. The built-in part (~15k YAML files, ~15 CPU-s to scan) is kept per lm-eval install in
`$NIGHTLOOM_CACHE/lm-eval/`, so a spec naming built-in tasks (or a misspelt one) is checked in well under a second
after the first time on a machine. A user's task folder is scanned every time (it changes; it is small)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from nightloom.util import atomic_write_text, cache_root

#: the cache file's own format; a file of another format (or unreadable) is scanned again and rewritten
FORMAT = 1
#: the config keys the data check reads (catalog._data_error) and a group's member list
KEPT = ("dataset_path", "dataset_name", "task")


@dataclass(frozen=True)
class IndexEntry:
    """One name of the index: kind ("task", "py_task", "group", "tag"), the names it is tagged with (for a tag:
    the tasks under it, as lm-eval keeps them) and its config reduced to KEPT and dataset_kwargs.data_files."""

    kind: str
    tags: tuple[str, ...]
    cfg: dict


def kept_config(cfg: object) -> dict:
    """The part of a task config the data check reads; a group's inline member configs reduced the same way."""
    if not isinstance(cfg, dict):
        return {}
    out = {k: cfg[k] for k in KEPT if k in cfg}
    kwargs = cfg.get("dataset_kwargs")
    if isinstance(kwargs, dict) and "data_files" in kwargs:
        out["dataset_kwargs"] = {"data_files": kwargs["data_files"]}
    if isinstance(out.get("task"), list):
        out["task"] = [kept_config(t) if isinstance(t, dict) else t for t in out["task"]]
    return json.loads(json.dumps(out, default=str))  # YAML dates and the like as text: the file is JSON


def scan(include_path: str | None, include_defaults: bool) -> dict[str, IndexEntry]:
    """lm-eval's own index (its TaskManager) over its built-in tasks and/or a folder, reduced to IndexEntry."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=include_path, include_defaults=include_defaults)
    return {
        name: IndexEntry(e.kind.name.lower(), tuple(sorted(e.tags)), kept_config(e.cfg))
        for name, e in tm.task_index.items()
    }


def cache_file() -> Path:
    """The built-in index's file for the lm-eval installed here (its version and where it lives)."""
    import lm_eval

    version = getattr(lm_eval, "__version__", "unknown")
    where = hashlib.sha256(str(Path(lm_eval.__file__).resolve().parent).encode()).hexdigest()[:12]
    return cache_root() / "lm-eval" / f"tasks-{version}-{where}.json"


def _read(path: Path) -> dict[str, IndexEntry] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT:
            return None
        return {n: IndexEntry(e["kind"], tuple(e["tags"]), e["cfg"]) for n, e in doc["entries"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # none yet, or a file this version cannot read: scan again


_BUILTIN: dict[str, IndexEntry] | None = None


def builtin_index() -> dict[str, IndexEntry]:
    """lm-eval's built-in tasks: from this process's copy, else the cache file, else a scan (then written)."""
    global _BUILTIN
    if _BUILTIN is None:
        path = cache_file()
        index = _read(path)
        if index is None:
            index = scan(None, include_defaults=True)
            entries = {n: {"kind": e.kind, "tags": list(e.tags), "cfg": e.cfg} for n, e in index.items()}
            try:
                atomic_write_text(path, json.dumps({"format": FORMAT, "entries": entries}))
            except OSError:
                pass  # a read-only home: the index still serves this process
        _BUILTIN = index
    return _BUILTIN


def task_index(tasks: list[str], include_path: str | None) -> dict[str, IndexEntry]:
    """The user's folder alone when it holds every task, else lm-eval's built-in tasks with the folder's over them
    (lm-eval's order: a folder's task overrides a built-in one of the same name)."""
    local = scan(include_path, include_defaults=False) if include_path else {}
    if include_path and all(t in local for t in tasks):
        return local
    return {**builtin_index(), **local}
