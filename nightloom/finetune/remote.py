"""XTuner on rented nodes (ssh, slurm): the XTuner env on every node, and XTuner's tools run on node 0.

Like the native backend, the run folder (config, processed dataset, work_dir, checkpoints) lies on storage
every node and the orchestrator see (a shared file system, as Slurm's state folder already assumes), so
results land in the run folder directly. What differs per node is the interpreter: `ensure_node_envs` runs
`nightloom.finetune.node_env` on each node (in parallel), which finds or builds the env keyed by the
requirements hash under the node's env root, under a lock, stamp last; the time to ready per node is kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nightloom.finetune.env import EnvError, XTunerEnv
from nightloom.finetune.launcher import WRAPPER, Command
from nightloom.finetune.node_env import MARK
from nightloom.provision.base import Cluster, Node, NodeShell

#: providers whose nodes are other machines (XTuner's env and tools run there, not on the orchestrator)
REMOTE_PROVIDERS = ("ssh", "slurm")


@dataclass(frozen=True)
class NodeEnv:
    """The XTuner env on one node: its interpreter, key and profile, and the time it took to be ready."""

    node: str
    python: str
    key: str
    profile: str
    created: bool  # built by this call (cold) rather than found (warm)
    ready_s: float  # round trip of the ensure step, as seen by the orchestrator
    versions: dict

    def as_env(self) -> XTunerEnv:
        """This node's env as an XTunerEnv (what plan_xtuner takes)."""
        py = Path(self.python)
        return XTunerEnv(py.parent.parent, py, self.key, self.profile, self.created, self.ready_s, self.versions)


def is_remote(cluster: Cluster | None) -> bool:
    return cluster is not None and cluster.provider in REMOTE_PROVIDERS


def profile_of(gpu_type: str) -> str:
    """The env profile a node needs: preflight has checked that every node has `cluster.gpu_type`'s GPUs."""
    return "cpu" if gpu_type == "cpu" else "gpu"


def wrapper_path(cluster: Cluster) -> str:
    """node_wrapper.py as the nodes see it: inside the code the ssh provider synced (relative to the node's
    workdir, where commands start), else this file's path (a shared file system, as on Slurm)."""
    key = cluster.handle.get("code_key")
    if cluster.provider == "ssh" and key:
        return f".nightloom/code/{key}/{WRAPPER.relative_to(WRAPPER.parents[2]).as_posix()}"
    return str(WRAPPER)


def _parse(node: str, output: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = " | ".join(output.strip().splitlines()[-4:])
    return {"ok": False, "error": f"no result from nightloom.finetune.node_env ({tail or 'no output'})"}


def ensure_node_envs(
    provider: NodeShell,
    cluster: Cluster,
    profile: str,
    *,
    python: str | None = None,
    log: Callable[[str], None] = print,
    timeout_s: float = 3600.0,
) -> dict[str, NodeEnv]:
    """Find or build the XTuner env on every node (verify `python` there instead when given); raise EnvError
    naming each node that failed. Nodes sharing an env root build it once (the file lock serialises them)."""

    def one(node: Node):
        argv = [node.python, "-m", "nightloom.finetune.node_env", "--profile", profile]
        if python:
            argv += ["--python", python]
        r = provider.run_on(cluster, node, argv, {"OMP_NUM_THREADS": "1"}, timeout_s=timeout_s)
        return node, r, _parse(node.name, r.output)

    with ThreadPoolExecutor(max_workers=min(16, len(cluster.nodes) or 1)) as pool:
        results = list(pool.map(one, cluster.nodes))
    bad = {n.name: info.get("error", f"exit {r.code}") for n, r, info in results if not info.get("ok") or r.code}
    if bad:
        why = "; ".join(f"node {k}: {v}" for k, v in bad.items())
        raise EnvError(f"XTuner env not ready on {why}" + (f" (train.xtuner.python={python!r})" if python else ""))
    out = {}
    for n, r, info in results:
        out[n.name] = NodeEnv(
            node=n.name,
            python=info["python"],
            key=info["key"],
            profile=info["profile"] if info["profile"] in ("cpu", "gpu") else profile,
            created=bool(info["created"]),
            ready_s=round(r.seconds, 3),
            versions=info.get("versions") or {},
        )
        log(
            f"xtuner env on node {n.name}: ready in {r.seconds:.2f} s ({'cold' if info['created'] else 'warm'}) "
            f"at {info['python']}"
        )
    return out


def node_runner(
    provider: NodeShell, cluster: Cluster, node: Node, timeout_s: float = 3600.0
) -> Callable[[Command, Path, Callable[[str], None], str], int]:
    """A tool runner (prepare, pth_to_hf, merge) that runs the command on `node`; its output goes to the log
    file and the log callback when it ends."""

    def run(cmd: Command, log_file: Path, log: Callable[[str], None], step: str) -> int:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        r = provider.run_on(cluster, node, cmd.argv, cmd.env, timeout_s=timeout_s)
        with open(log_file, "a", encoding="utf-8") as f:
            f.write(f"$ [{node.name}] {' '.join(cmd.argv)}\n{r.output}\n[exit {r.code}]\n")
        for line in r.output.splitlines():
            log(f"[{step}@{node.name}] {line}")
        return r.code

    return run
