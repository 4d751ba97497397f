"""The XTuner node environment: a separate venv keyed by the hash of its requirements file, created or verified.

xtuner 0.2.0 pins transformers 4.48 and needs datasets<4, so it can never share the orchestrator's venv.
The env lives at `$NIGHTLOOM_XTUNER_ENV` when set, else `<root>/<key>` with root `~/.cache/nightloom/envs`
(or `$NIGHTLOOM_ENV_ROOT`). A stamp file written last marks a complete env; creation holds a file lock, so
concurrent callers (pytest workers, two flows) build it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nightloom.node_reply import Readied
from nightloom.util import atomic_write_text

HERE = Path(__file__).resolve().parent
STAMP = ".nightloom-env.json"
Profile = Literal["cpu", "gpu"]

# What each profile installs: the requirements file, whether it is a full lock (--no-deps), and fix-ups after it.
PROFILES: dict[str, dict] = {
    "cpu": {"requirements": HERE / "requirements.txt", "no_deps": True, "after": []},
    "gpu": {
        "requirements": HERE / "requirements-gpu.txt",
        "no_deps": False,
        "after": [["--no-deps", "bitsandbytes==0.45.1"]],
    },
}

# xtuner/dataset/__init__.py imports internvl_dataset, which imports torchvision.transforms at module level.
# The CPU profile has no torchvision (the PyPI wheel is a CUDA build), so the env gets this stub. It has no
# dist-info, so transformers still reports torchvision as unavailable, which is what we want.
_TV_STUB = {
    "__init__.py": '"""Stub: only what xtuner.dataset.internvl_dataset imports at module level (no real ops)."""\n'
    "from . import transforms  # noqa: F401\n__version__ = '0.0.0+nightloom.stub'\n",
    "transforms/__init__.py": "class _Missing:\n    def __init__(self, *a, **k):\n"
    "        raise RuntimeError('torchvision is a stub in this env (InternVL unsupported)')\n\n"
    "Compose = Lambda = Resize = ToTensor = Normalize = RandomResizedCrop = _Missing\n"
    "from . import functional  # noqa: F401,E402\n",
    "transforms/functional.py": "import enum\n\n\nclass InterpolationMode(enum.Enum):\n"
    "    NEAREST = 'nearest'\n    BILINEAR = 'bilinear'\n    BICUBIC = 'bicubic'\n",
}
_STUB_VERSION = "1"


class EnvError(RuntimeError):
    """The XTuner env could not be created or does not work; the message names the step and the log file."""


@dataclass(frozen=True)
class XTunerEnv(Readied):
    """A ready XTuner node environment: its folder, interpreter, profile and what the probe found in it."""

    path: Path
    python: Path
    profile: str
    versions: dict


def detect_profile() -> Profile:
    """`gpu` when an NVIDIA driver answers on this machine, else `cpu`."""
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True, timeout=30, check=False).returncode == 0:
        return "gpu"
    return "cpu"


def env_key(profile: Profile = "cpu") -> str:
    """sha256 over the requirements file, the profile's fix-ups, the stub and the Python minor version."""
    p = PROFILES[profile]
    h = hashlib.sha256()
    h.update(p["requirements"].read_bytes())
    h.update(json.dumps([profile, p["no_deps"], p["after"], _STUB_VERSION, sys.version_info[:2]]).encode())
    return h.hexdigest()[:16]


def env_root() -> Path:
    return Path(os.environ.get("NIGHTLOOM_ENV_ROOT", "~/.cache/nightloom/envs")).expanduser()


def env_path(profile: Profile = "cpu") -> Path:
    """Where the env for this profile lives: `$NIGHTLOOM_XTUNER_ENV` or `<root>/xtuner-<profile>-<key>`."""
    explicit = os.environ.get("NIGHTLOOM_XTUNER_ENV")
    if explicit:
        return Path(explicit).expanduser().resolve()
    return env_root() / f"xtuner-{profile}-{env_key(profile)}"


def _python_of(path: Path) -> Path:
    return path / "bin" / "python"


def _read_stamp(path: Path) -> dict | None:
    try:
        return json.loads((path / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def probe(python: str | Path, timeout_s: float = 300) -> dict:
    """Run the node wrapper's `probe` in `python`: versions, CUDA, map functions and prompt templates."""
    r = subprocess.run(
        [str(python), str(HERE / "node_wrapper.py"), "probe"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    if r.returncode != 0:
        raise EnvError(f"XTuner env at {python} does not work (probe exit {r.returncode}):\n{r.stderr[-2000:]}")
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise EnvError(f"XTuner env at {python}: probe printed no JSON: {r.stdout[-500:]!r}") from None


def _run_logged(argv: list[str], log_file: Path, step: str, timeout_s: float) -> None:
    with open(log_file, "a", encoding="utf-8") as f:
        f.write(f"\n$ {' '.join(argv)}\n")
        f.flush()
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if r.returncode != 0:
        tail = log_file.read_text(encoding="utf-8", errors="replace")[-1500:]
        raise EnvError(f"XTuner env: {step} failed (exit {r.returncode}); full log: {log_file}\n{tail}")


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def _install_stub(python: Path) -> None:
    site = _site_packages(python)
    if (site / "torchvision").exists() and not (site / "torchvision" / ".nightloom-stub").exists():
        return  # a real torchvision (GPU profile)
    for rel, text in _TV_STUB.items():
        f = site / "torchvision" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text, encoding="utf-8")
    (site / "torchvision" / ".nightloom-stub").write_text("", encoding="utf-8")


def _uv() -> str | None:
    """The `uv` installer next to this interpreter (a pinned dependency of nightloom), or on PATH."""
    here = Path(sys.executable).parent / "uv"
    return str(here) if here.is_file() else shutil.which("uv")


def _create(path: Path, profile: Profile, base_python: str, log: Callable[[str], None], timeout_s: float) -> None:
    prof = PROFILES[profile]
    if path.exists():
        shutil.rmtree(path)  # incomplete (no valid stamp): start over
    path.parent.mkdir(parents=True, exist_ok=True)
    log_file = path.parent / f"{path.name}.install.log"
    log_file.write_text("", encoding="utf-8")
    log(f"xtuner env: creating {path} (profile {profile}); log {log_file}")
    _run_logged([base_python, "-m", "venv", str(path)], log_file, "venv", 300)
    py = str(_python_of(path))
    # torch through pip, so pip's own config (find-links, index) picks the wheel (here the local CPU build); the
    # rest through uv when the orchestrator's venv has it (seconds instead of minutes), else pip. Byte-compiled once
    # at the end: under PYTHONDONTWRITEBYTECODE=1 (common in images and CI) every rank would otherwise recompile
    # torch and transformers on each launch.
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-compile"]
    no_deps = ["--no-deps"] if prof["no_deps"] else []  # the GPU profile resolves torch's CUDA libraries
    _run_logged(pip + no_deps + ["torch==2.13.0"], log_file, "pip install torch", timeout_s)
    uv = _uv()
    install = [uv, "pip", "install", "--python", py] if uv else pip
    _run_logged(
        install + (no_deps or ["--no-build-isolation"]) + ["-r", str(prof["requirements"])],
        log_file,
        f"{'uv ' if uv else ''}pip install -r {prof['requirements'].name}",
        timeout_s,
    )
    for extra in prof["after"]:
        _run_logged(install + extra, log_file, f"pip install {' '.join(extra)}", timeout_s)
    _install_stub(Path(py))
    _compile_site_packages(py, log_file, timeout_s)


def _compile_site_packages(py: str, log_file: Path, timeout_s: float) -> None:
    """Write .pyc for the whole env. A failure only costs speed (a few packages ship template .py files that do not
    parse), so it is logged, never fatal."""
    code = (
        "import compileall, site, sys; [compileall.compile_dir(d, quiet=2, workers=0) for d in site.getsitepackages()]"
    )
    try:
        _run_logged([py, "-c", code], log_file, "byte-compile site-packages", timeout_s)
    except (EnvError, subprocess.TimeoutExpired) as e:  # an uncompiled env still works, only slower to import
        with log_file.open("a", encoding="utf-8") as f:
            f.write(f"byte-compile skipped: {e}\n")


def ensure_env(
    python: str | None = None,
    profile: Profile | None = None,
    base_python: str | None = None,
    log: Callable[[str], None] = print,
    timeout_s: float = 1800,
    verify: bool = False,
) -> XTunerEnv:
    """Return a working XTuner env: verify `python` when given, else find or build the env for `profile`.

    Warm path (stamp matches the key): no subprocess unless `verify` (a probe that imports xtuner, ~5-10 s).
    Cold path: venv + pip install under a file lock, then a probe; the stamp is written last.
    """
    t0 = time.monotonic()
    if python is not None:  # a user-provided interpreter (spec.train.xtuner.python): verify, never modify
        info = probe(python)
        return XTunerEnv(
            key="external",
            created=False,
            seconds=time.monotonic() - t0,
            path=Path(python).parent.parent,
            python=Path(python),
            profile=info.get("profile", "?"),
            versions=info,
        )
    profile = profile or detect_profile()
    key = env_key(profile)
    path = env_path(profile)
    path.parent.mkdir(parents=True, exist_ok=True)
    created = False
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = _read_stamp(path)
        if stamp is None or stamp.get("key") != key or not _python_of(path).exists():
            _create(path, profile, base_python or sys.executable, log, timeout_s)
            created = True
        info = (
            probe(_python_of(path)) if (created or verify) else {**stamp.get("info", {}), "versions": stamp["versions"]}
        )
        if created:
            stamp = {
                "key": key,
                "profile": profile,
                "created_unix": time.time(),
                "create_s": round(time.monotonic() - t0, 1),
                "versions": info["versions"],
                "info": {k: v for k, v in info.items() if k != "versions"},
            }
            atomic_write_text(path / STAMP, json.dumps(stamp, indent=2) + "\n")
            log(f"xtuner env: ready in {stamp['create_s']} s: {info['versions']}")
    return XTunerEnv(
        key=key,
        created=created,
        seconds=time.monotonic() - t0,
        path=path,
        python=_python_of(path),
        profile=profile,
        versions=info,
    )
