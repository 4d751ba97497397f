"""`make ui` takes a port (`make ui PORT=4201`), and a busy port's message says how to give one with make too."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from flows.commands.ui import Stack, UIError, bring_up

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_ui_passes_port_and_ignores_a_port_in_the_environment():
    def dry_run(*argv: str, env: dict[str, str] | None = None) -> str:
        cmd = ["make", "-n", "-o", ".venv/.installed", "ui", *argv]  # -o: never rebuild the venv here
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout

    assert "nightloom ui --port 4201" in dry_run("PORT=4201")
    assert "nightloom ui --port 4200" in dry_run(env={**os.environ, "PORT": "8080"})


def test_a_busy_port_names_make_ui_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UIError) as e:
            bring_up(Stack(), ROOT, port, tmp_path, timeout=1)
    assert f"make ui PORT={port + 1}" in str(e.value) and f"nightloom ui --port {port + 1}" in str(e.value)
