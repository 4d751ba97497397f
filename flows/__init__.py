"""Prefect flows: the whole run (`training_pipeline`) and its parts. Flows only orchestrate."""

from __future__ import annotations

import os

# Defaults that make a notebook or script work with no server configured (ephemeral mode). Set before
# Prefect is imported; a user's own settings (env or profile) win.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def __getattr__(name: str):
    # lazy, so `import flows.cli` stays fast for pure commands (plan, shard --json, ledger)
    if name == "training_pipeline":
        from flows.pipeline import training_pipeline

        return training_pipeline
    raise AttributeError(name)


__all__ = ["training_pipeline"]
