"""examples/quickstart.ipynb executes top to bottom (with a shorter spec)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import yaml
from nbclient import NotebookClient

from tests.support.pipeline import small_demo

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_notebook_executes(prefect_backend, tmp_path, monkeypatch):
    spec = small_demo(tmp_path, steps=6, checkpoint_every=0)
    data = yaml.safe_load(spec.read_text())
    data["cluster"].update({"nodes": 1, "gpus_per_node": 2})  # the notebook, not the layout, is under test
    spec.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("NIGHTLOOM_SPEC", str(spec))
    monkeypatch.setenv("PREFECT_API_URL", prefect_backend)
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "completed" in outputs
