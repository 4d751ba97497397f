"""One answer to "are we in CI?": a test that needs a system service skips outside CI and fails in it."""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_or_fail(msg: str) -> None:
    """Skip with `msg` on a developer machine; fail with it in CI, where every service must be present."""
    if in_ci():
        pytest.fail(msg)
    pytest.skip(msg)


def require_binary(name: str, *candidates: str) -> str:
    """Path of a system binary; skip the test without it, fail instead in CI."""
    for c in (name, *candidates):
        p = shutil.which(c) or (c if os.path.isabs(c) and os.path.exists(c) else None)
        if p:
            return p
    skip_or_fail(f"{name} is not installed (CI installs it via .ci/run)")
    raise AssertionError("unreachable")
