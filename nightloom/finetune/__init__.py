"""XTuner as a fine-tuning backend: its own node env, rendered configs, a wrapper launch, metrics and conversion.

Pure logic like the rest of nightloom (no Prefect). xtuner itself is never imported here: it lives in the
env built by `env.ensure_env` and runs through `node_wrapper.py`. Entry point: `run_xtuner`.
"""

from nightloom.finetune.config import XTunerConfigError
from nightloom.finetune.env import EnvError, XTunerEnv, ensure_env
from nightloom.finetune.launcher import XTunerLaunchError
from nightloom.finetune.run import XTunerPlan, XTunerResult, run_xtuner

__all__ = [
    "EnvError",
    "XTunerConfigError",
    "XTunerEnv",
    "XTunerLaunchError",
    "XTunerPlan",
    "XTunerResult",
    "ensure_env",
    "run_xtuner",
]
