"""examples/quickstart.ipynb executes top to bottom in a real kernel (with a shorter spec): a wrong spec path
fails before any server starts, naming it and the current folder; the summary displays as an HTML table with
the status, layout, losses and the loss curve as an inline PNG."""

from __future__ import annotations

import base64
import re
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
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    printed = "".join(o.get("text", "") for o in outputs)
    assert f"no file {ROOT / 'deployments' / 'no-such-spec.yaml'} (current folder {ROOT})" in printed, printed
    assert "Starting temporary server" not in printed.split("no-such-spec")[0]
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    for row in ("<th style='text-align:left'>status</th><td style='text-align:left'>completed",
                "TP1·PP1·DP2 on 2 ranks", "loss", "over 6 steps"):  # fmt: skip
        assert row in html, row
    assert re.search(r"\d\.\d{4} -&gt; \d\.\d{4} over 6 steps", html), html
    png = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html)
    assert png and base64.b64decode(png.group(1)).startswith(b"\x89PNG")


def test_a_missing_spec_fails_before_prefect_is_imported(tmp_path):
    """From another folder, a relative spec path that is not there fails at once, naming the path it looked for
    and the current folder; no server was started (Prefect was not even imported)."""
    import subprocess
    import sys

    code = (
        "import sys, flows\n"
        "try:\n"
        "    flows.training_pipeline('deployments/local-demo.yaml')\n"
        "except FileNotFoundError as e:\n"
        "    print(e)\n"
        "print('prefect imported:', 'prefect' in sys.modules)\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"no file {tmp_path / 'deployments' / 'local-demo.yaml'} (current folder {tmp_path})" in out.stdout
    assert "prefect imported: False" in out.stdout
