"""Runs ON a node: find or build the XTuner env there (`env.ensure_env`) and print one JSON line about it.

    python -m nightloom.finetune.node_env --profile cpu|gpu [--python PATH]

The orchestrator runs it on every node through the provider (nightloom/finetune/remote.py); the node's env
root (`$NIGHTLOOM_ENV_ROOT`, default ~/.cache/nightloom/envs) is its cache, shared by the nodes that share a
home or file system, so the env is built once there. `--python` verifies a user-given interpreter instead.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from nightloom.finetune.env import EnvError, ensure_env
from nightloom.node_reply import reply, reply_error

MARK = "NIGHTLOOM_XTUNER_ENV "


def gpu_names() -> list[str]:
    """The node's GPU models as nvidia-smi names them ([] without a driver): the MFU peak comes from these."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    r = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    return [x.strip() for x in r.stdout.splitlines() if x.strip()] if r.returncode == 0 else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nightloom.finetune.node_env")
    ap.add_argument("--profile", choices=("cpu", "gpu"), required=True)
    ap.add_argument("--python", default=None, help="a given XTuner interpreter: verify it, build nothing")
    a = ap.parse_args(argv)
    try:
        env = ensure_env(python=a.python, profile=a.profile, log=lambda s: print(s, file=sys.stderr, flush=True))
    except (EnvError, OSError) as e:
        return reply_error(MARK, e)
    versions = env.versions.get("versions", env.versions)
    fields = {"python": str(env.python), "profile": env.profile, **env.reply_fields(), "versions": versions}
    reply(MARK, fields | {"gpus": gpu_names()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
