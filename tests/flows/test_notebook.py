"""examples/quickstart.ipynb executes top to bottom (with a shorter spec)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tests.support.pipeline import small_demo

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_notebook_executes(prefect_backend, tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTLOOM_SPEC", str(small_demo(tmp_path, steps=6, checkpoint_every=0)))
    monkeypatch.setenv("PREFECT_API_URL", prefect_backend)
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "completed" in outputs
