"""XTuner fixtures: the node env (built once, cached by its requirements hash), offline HF settings, a tiny base model."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nightloom.finetune.xtuner_plan import TINY_MODEL_SCRIPT
from tests.support.ci import in_ci

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


@pytest.fixture(scope="session")
def hf_offline(tmp_path_factory):
    """Every test and every process it starts runs offline, with a private HF cache."""
    saved = {k: os.environ.get(k) for k in [*OFFLINE, "HF_HOME"]}
    os.environ.update(OFFLINE)
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf_home"))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def xtuner_env(hf_offline):
    """The XTuner CPU env: built on first use (minutes), then found by its requirements hash (seconds)."""
    from nightloom.finetune.env import EnvError, ensure_env

    t0 = time.monotonic()
    try:
        env = ensure_env(profile="cpu", log=lambda s: print(s, file=sys.stderr))
    except (EnvError, subprocess.SubprocessError, OSError) as e:
        if in_ci():
            raise
        pytest.skip(f"XTuner env could not be created (set CI=true to fail instead): {e}")
    print(
        f"\nxtuner env {'created' if env.created else 'found'} in {time.monotonic() - t0:.1f} s: {env.path}",
        file=sys.stderr,
    )
    return env


@pytest.fixture(scope="session")
def base_model(xtuner_env, tmp_path_factory) -> Path:
    """A tiny random Llama + byte-level BPE tokenizer, saved by a script run in the XTuner env."""
    out = tmp_path_factory.mktemp("base_model")
    r = subprocess.run(
        [str(xtuner_env.python), str(TINY_MODEL_SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return out
