"""The Prefect settings nightloom's entry points run with unless the user gave their own (env or profile).

Applied by an explicit call, never on import: the `nightloom` CLI (flows/cli.py `main`), the notebook entry
(`flows.training_pipeline`), a flow module run as `__main__`, and the processes `nightloom ui` starts (server,
worker and, through the worker, every deployment's flow run: flows/commands/ui.py `prefect_env`). The call must come
before Prefect's first import in the process: Prefect reads its console handler's class
(PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS, a logging.yml override, not a setting) from the environment once, when
`import prefect` runs its logging setup (prefect/main.py: setup_logging), and its settings when it first builds
them. This module imports nothing of Prefect for that reason.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: name -> value, each kept only where the environment has none
PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry from a notebook's or a CLI's temporary server
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",  # a temporary server on a loaded 2-core box
    "OMP_NUM_THREADS": "1",
    # log messages printed as written: Prefect's console handler would turn `corpus.jsonl:100:` into an emoji
    "PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS": "flows.console.VerbatimConsoleHandler",
}


def set_prefect_defaults(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Give `env` (default: this process's environment) each of PREFECT_DEFAULTS it lacks; returns `env`."""
    env = os.environ if env is None else env
    for name, value in PREFECT_DEFAULTS.items():
        env.setdefault(name, value)
    return env
