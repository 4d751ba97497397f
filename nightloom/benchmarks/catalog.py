"""lm-eval's task index, read at validate (no model is loaded; task_index.py keeps the built-in part): task names
that do not exist, and tasks whose data needs the network and is not in the local cache, each named with its
dataset."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from nightloom.benchmarks.task_index import IndexEntry, task_index

#: datasets' packaged builders that read local files given in data_files
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "imagefolder", "audiofolder"}


def task_manager(tasks: list[str], include_path: str | None):
    """A TaskManager over the user's folder alone when it holds every task (lm-eval's own index of ~15k tasks
    takes seconds to build), else over both."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
        return TaskManager(include_path=include_path)
    return TaskManager()


def _leaf_configs(index: dict[str, IndexEntry], name: str, seen: set[str] | None = None) -> list[tuple[str, dict]]:
    """(task name, config) of every task under a task, group or tag name (Python-defined tasks have none)."""
    seen = seen if seen is not None else set()
    entry = index.get(name)
    if entry is None or name in seen:
        return []
    seen.add(name)
    if entry.kind == "task":
        return [(name, entry.cfg)]
    if entry.kind == "tag":
        return [x for n, e in index.items() if name in e.tags for x in _leaf_configs(index, n, seen)]
    if entry.kind == "group":
        subs = entry.cfg.get("task") or []
        out = []
        for s in subs if isinstance(subs, list) else [subs]:
            if isinstance(s, str):
                out += _leaf_configs(index, s, seen)
            elif isinstance(s, dict) and isinstance(s.get("task"), str):
                out.append((s["task"], s))
        return out
    return []


def _hub_cached(path: str) -> bool:
    """Whether a Hub dataset is in datasets' cache or the Hub's download cache on this machine."""
    from datasets import config as ds_config
    from huggingface_hub import constants

    ds = Path(ds_config.HF_DATASETS_CACHE) / path.replace("/", "___")
    hub = Path(constants.HF_HUB_CACHE) / ("datasets--" + path.replace("/", "--"))
    return ds.is_dir() or hub.is_dir()


def _data_error(task: str, cfg: dict, folder: Path) -> str | None:
    path = cfg.get("dataset_path")
    if not isinstance(path, str):
        return None
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if path in LOCAL_BUILDERS:
        names = files.values() if isinstance(files, dict) else [files] if files else []
        flat = [f for n in names for f in (n if isinstance(n, list) else [n]) if isinstance(f, str)]
        missing = [f for f in flat if "://" not in f and not (folder / os.path.expanduser(f)).exists()]
        return (
            f"task {task!r}: data file(s) not found: {', '.join(missing)} (relative to {folder})" if missing else None
        )
    if (folder / os.path.expanduser(path)).exists():
        return None
    if _hub_cached(path):
        return None
    name = cfg.get("dataset_name")
    return (
        f"task {task!r} needs dataset {path!r}" + (f" ({name})" if name else "") + " from the Hugging Face Hub, "
        "which is not in the local cache: benchmarks run offline; download it once or use local data_files"
    )


def task_errors(tasks: list[str], include_path: str | None) -> list[tuple[int, str]]:
    """(index in tasks, reason) for each unknown task name and each task whose data is not on this machine."""
    index = task_index(tasks, include_path)
    folder = Path(include_path) if include_path else Path.cwd()
    out = []
    for i, name in enumerate(tasks):
        if name not in index:
            close = difflib.get_close_matches(name, sorted(index), n=3)
            where = f" in {include_path} or lm-eval's tasks" if include_path else " among lm-eval's tasks"
            out.append((i, f"unknown task {name!r}{where}" + (f"; close: {', '.join(close)}" if close else "")))
            continue
        for task, cfg in _leaf_configs(index, name):
            if (err := _data_error(task, cfg, folder)) is not None:
                out.append((i, err))
    return out


def spec_errors(data: dict, local) -> list[tuple[tuple, str]]:
    """(field path, reason) for validate.benchmarks of a raw spec mapping: its include_path, gates that compare
    with a base the run cannot read, then each task (a `demo_task` not built yet is left to the run, which builds
    it). `local` resolves a path against the spec."""
    bench = (data.get("validate") or {}).get("benchmarks") if isinstance(data.get("validate"), dict) else None
    if not isinstance(bench, dict) or not isinstance(bench.get("tasks"), list) or not bench["tasks"]:
        return []
    at, errs = ("validate", "benchmarks"), []
    weights = (data.get("model") or {}).get("weights") if isinstance(data.get("model"), dict) else None
    if local(weights) is None and bench.get("base", True) is not False:
        for i, g in enumerate(bench.get("gates") or []):
            if isinstance(g, dict) and (g.get("min_gain") is not None or g.get("max_drop") is not None):
                why = "an s3:// model.weights is not read here" if weights else "the run has no model.weights"
                errs.append(((*at, "gates", str(i)), f"min_gain and max_drop compare with the base: {why}"))
    folder = local(bench.get("include_path"))
    if bench.get("include_path") is not None and (folder is None or not folder.is_dir()):
        if bench.get("demo_task") is None:
            return [*errs, ((*at, "include_path"), f"not a folder: {folder or bench.get('include_path')}")]
    tasks = [t for t in bench["tasks"] if isinstance(t, str)]
    if bench.get("demo_task") in tasks and not (
        folder is not None and (folder / f"{bench['demo_task']}.yaml").is_file()
    ):
        tasks = [t for t in tasks if t != bench["demo_task"]]
    if not tasks:
        return errs
    include = str(folder) if folder is not None and folder.is_dir() else None
    return errs + [((*at, "tasks", str(bench["tasks"].index(tasks[i]))), why) for i, why in task_errors(tasks, include)]
