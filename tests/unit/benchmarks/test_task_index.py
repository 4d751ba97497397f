"""The task index validate reads (nightloom/benchmarks/task_index.py): lm-eval's built-in part is scanned once
and kept per lm-eval install, and the kept index gives the same verdicts as the scan it came from. Here lm-eval's
real scanner reads a small folder standing in for its built-in tasks (the real 15k take ~15 CPU-s; a check over
all of them, 14,683 names, gave no difference on 2026-12-07)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nightloom.benchmarks import catalog, task_index

HUB = "task: t_hub\ndataset_path: someorg/hub-only\ndataset_name: main\ntag: [t_tag]\n"
FILES = "task: t_files\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: absent.jsonl\ntag: t_tag\n"
GROUP = (
    "group: t_group\ntask:\n  - t_hub\n  - task: t_inline\n    dataset_path: otherorg/inline\n"
    "    dataset_kwargs: {trust_remote_code: true}\n    added: 2024-01-02\n"
)
NEEDS_HUB = "from the Hugging Face Hub, which is not in the local cache"
EXPECTED = [
    (0, f"task 't_hub' needs dataset 'someorg/hub-only' (main) {NEEDS_HUB}"),
    (1, "task 't_files': data file(s) not found: absent.jsonl"),
    (2, f"task 't_hub' needs dataset 'someorg/hub-only' (main) {NEEDS_HUB}"),
    (2, f"task 't_inline' needs dataset 'otherorg/inline' {NEEDS_HUB}"),
    (3, "task 't_files': data file(s) not found: absent.jsonl"),  # a tag's tasks in lm-eval's order (file names)
    (3, f"task 't_hub' needs dataset 'someorg/hub-only' (main) {NEEDS_HUB}"),
    (4, "unknown task 't_hubb' among lm-eval's tasks; close: t_hub"),
]
NAMES = ["t_hub", "t_files", "t_group", "t_tag", "t_hubb"]


@pytest.fixture
def builtins(tmp_path, monkeypatch):
    """A folder scanned by lm-eval as if it were its built-in tasks; the cache under tmp_path; scans counted."""
    folder = tmp_path / "builtin"
    folder.mkdir()
    for name, text in (("hub", HUB), ("files", FILES), ("group", GROUP)):
        (folder / f"{name}.yaml").write_text(text)
    real, scans = task_index.scan, []

    def scan(include_path, include_defaults):
        scans.append((include_path, include_defaults))
        return real(str(folder), False) if include_defaults else real(include_path, False)

    monkeypatch.setattr(task_index, "scan", scan)
    monkeypatch.setattr(task_index, "_BUILTIN", None)
    monkeypatch.setenv("NIGHTLOOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(folder)  # relative data_files of a built-in task are checked against the working folder
    return scans


def _reset():
    task_index._BUILTIN = None  # a new process: only the file remains


def _truncate(errs):
    return [(i, why.split(": benchmarks run offline")[0].split(" (relative to")[0]) for i, why in errs]


def test_scanned_once_then_read_back_with_the_same_verdicts(builtins):
    assert _truncate(catalog.task_errors(NAMES, None)) == EXPECTED
    assert builtins == [(None, True)]
    path = task_index.cache_file()
    assert path.parent == Path(os.environ["NIGHTLOOM_CACHE"]) / "lm-eval" and path.is_file()
    _reset()
    assert _truncate(catalog.task_errors(NAMES, None)) == EXPECTED
    assert builtins == [(None, True)]  # read back, not scanned again
    inline = json.loads(path.read_text())["entries"]["t_group"]["cfg"]["task"][1]
    assert inline == {"task": "t_inline", "dataset_path": "otherorg/inline"}  # only what the data check reads


def test_an_unreadable_or_older_cache_is_scanned_again_and_rewritten(builtins):
    path = task_index.cache_file()
    path.parent.mkdir(parents=True)
    for bad in ("{not json", json.dumps({"format": task_index.FORMAT + 1, "entries": {}})):
        path.write_text(bad)
        _reset()
        assert _truncate(catalog.task_errors(NAMES, None)) == EXPECTED
        assert json.loads(path.read_text())["format"] == task_index.FORMAT
    assert builtins == [(None, True), (None, True)]


def test_another_lm_eval_version_has_its_own_file(builtins, monkeypatch):
    import lm_eval

    first = task_index.cache_file()
    monkeypatch.setattr(lm_eval, "__version__", "0.0.0-other", raising=False)
    assert task_index.cache_file() != first and "0.0.0-other" in task_index.cache_file().name


def test_a_folder_holding_every_task_is_read_alone_and_overrides_a_builtin(builtins, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "hub.yaml").write_text("task: t_hub\ndataset_path: json\ndataset_kwargs:\n  data_files: h.jsonl\n")
    (mine / "h.jsonl").write_text('{"q": 1}\n')
    assert catalog.task_errors(["t_hub"], str(mine)) == []
    assert builtins == [(str(mine), False)]  # the built-in index was not needed
    errs = catalog.task_errors(["t_hub", "t_files"], str(mine))
    assert _truncate(errs) == [(1, "task 't_files': data file(s) not found: absent.jsonl")]  # mine wins for t_hub
    assert builtins[-1] == (None, True)
