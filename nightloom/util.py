"""Small shared helpers: atomic writes (write, then rename) so no reader sees a half-written file, and the usual
file modes (umask-respecting) for what a run publishes."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """nightloom's per-user cache, kept from run to run: `$NIGHTLOOM_CACHE`, else ~/.cache/nightloom."""
    return Path(os.environ.get("NIGHTLOOM_CACHE", Path.home() / ".cache" / "nightloom"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def share_mode(path: str | Path) -> Path:
    """Give `path` (a file, or a folder and everything under it) the mode a plain `open()` / `mkdir()` would:
    0666 / 0777 less the umask. Writers that go through mkstemp / mkdtemp or safetensors' `save_file` get 0600 /
    0700, which a teammate sharing the run folder cannot read; call this on the temp path before publishing it."""
    p = Path(path)
    mask = _umask()
    paths = [p, *p.rglob("*")] if p.is_dir() and not p.is_symlink() else [p]
    for q in paths:
        if not q.is_symlink():
            os.chmod(q, (0o777 if q.is_dir() else 0o666) & ~mask)
    return p


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Temp file in the same folder, fsync, then os.replace: readers see the old file or the new one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        share_mode(tmp)  # mkstemp makes 0600; readers on other accounts need the usual mode
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


#: torch's UserWarning on every `dcp.load(..., no_dist=True)`: the one-process read is what nightloom means there
NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


@contextmanager
def quiet_no_dist() -> Iterator[None]:
    """Silence that one warning for the block (export and eval read a checkpoint in one process on purpose); every
    other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING, category=UserWarning)
        yield


@contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' tqdm bars ("Writing model shards") off for the block, as they were after: a demo's weights
    are built in a fraction of a second and the bar is noise in the run's output."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
