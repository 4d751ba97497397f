"""XTuner on rented nodes (ssh, slurm): the XTuner env on every node, and XTuner's tools run on node 0.

Like the native backend, the run folder (config, processed dataset, work_dir, checkpoints) lies on storage
every node and the orchestrator see (a shared file system, as Slurm's state folder already assumes), so
results land in the run folder directly. What differs per node is the interpreter: `ensure_node_envs` runs
`nightloom.finetune.node_env` on each node (in parallel), which finds or builds the env keyed by the
requirements hash under the node's env root, under a lock, stamp last; the time to ready per node is kept.
`RunNodes` readies a run's nodes (env, base model, run folder), and recovery's new ones the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from nightloom.finetune.env import EnvError, XTunerEnv
from nightloom.finetune.launcher import WRAPPER, Command
from nightloom.finetune.node_env import MARK
from nightloom.finetune.xtuner_plan import XTunerPlan
from nightloom.node_reply import output_tail, read_reply
from nightloom.provision.base import REMOTE_PROVIDERS, Cluster, Node, NodeShell


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
    gpus: tuple[str, ...] = ()  # GPU models as the node reports them

    def as_env(self) -> XTunerEnv:
        """This node's env as an XTunerEnv (what plan_xtuner takes)."""
        py = Path(self.python)
        return XTunerEnv(
            key=self.key,
            created=self.created,
            seconds=self.ready_s,
            path=py.parent.parent,
            python=py,
            profile=self.profile,
            versions=self.versions,
        )


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


def _parse_mark(mark: str, output: str) -> dict:
    """The reply a node-side module printed after `mark`, or a failure naming the output's tail."""
    got = read_reply(mark, output)
    return got if got is not None else {"ok": False, "error": f"no result from the node ({output_tail(output)})"}


def _parse(node: str, output: str) -> dict:
    return _parse_mark(MARK, output)


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
            gpus=tuple(info.get("gpus") or ()),
        )
        log(
            f"xtuner env on node {n.name}: ready in {r.seconds:.2f} s ({'cold' if info['created'] else 'warm'}) "
            f"at {info['python']}"
        )
    return out


def ensure_node_models(
    provider: NodeShell,
    cluster: Cluster,
    uri: str,
    endpoint: str | None,
    *,
    log: Callable[[str], None] = print,
    timeout_s: float = 3600.0,
) -> str:
    """Fetch (or find) the s3:// base model in every node's cache (`nightloom.finetune.base_model`, in
    parallel; nodes sharing a cache download it once); return its folder, which must be the same path on
    every node (XTuner's config names one). XTunerConfigError naming each node that failed."""
    from nightloom.finetune import base_model as bm
    from nightloom.finetune.config import XTunerConfigError

    env = {"OMP_NUM_THREADS": "1", **bm.forward_env()}

    def one(node: Node):
        r = provider.run_on(cluster, node, bm.node_argv(node.python, uri, endpoint), env, timeout_s=timeout_s)
        return node, r, _parse_mark(bm.MARK, r.output)

    with ThreadPoolExecutor(max_workers=min(16, len(cluster.nodes) or 1)) as pool:
        results = list(pool.map(one, cluster.nodes))
    bad = {n.name: info.get("error", f"exit {r.code}") for n, r, info in results if not info.get("ok") or r.code}
    if bad:
        raise XTunerConfigError("model.weights: " + "; ".join(f"node {k}: {v}" for k, v in bad.items()))
    paths = {info["path"] for _, _, info in results}
    if len(paths) > 1:
        where = ", ".join(f"{n.name}: {info['path']}" for n, _, info in results)
        raise XTunerConfigError(
            f"model.weights: the nodes cache {uri} at different paths ({where}); set NIGHTLOOM_MODEL_CACHE to "
            "one path every node has"
        )
    for n, r, info in results:
        log(f"base model on node {n.name}: {'fetched' if info['created'] else 'cached'} in {r.seconds:.2f} s")
    return paths.pop()


@dataclass
class RunNodes:
    """A run's rented nodes made ready for XTuner: the env on each (`envs`), the s3:// base model in their
    caches (`base_path`, one path on every node), and, for a node recovery adds, the run folder seen there."""

    spec: object  # the RunSpec
    provider: NodeShell
    run_dir: Path
    log: Callable[[str], None] = print
    envs: dict[str, NodeEnv] = field(default_factory=dict)
    base_path: str | None = None  # None: the base model is a folder the nodes share with this machine

    def ensure_envs(self, cluster: Cluster) -> XTunerEnv:
        """The XTuner env on every node of `cluster` not readied yet; node 0's env (XTuner's tools run there)."""
        new = [n for n in cluster.nodes if n.name not in self.envs]
        if new:
            sub = cluster.model_copy(update={"nodes": new})
            xs = self.spec.train.xtuner
            self.envs.update(
                ensure_node_envs(
                    self.provider, sub, profile_of(self.spec.cluster.gpu_type), python=xs.python, log=self.log
                )
            )
        return self.envs[cluster.nodes[0].name].as_env()

    def ensure_model(self, cluster: Cluster) -> str | None:
        """The s3:// base model in the caches of `cluster`'s nodes (None for a local one); the same path as before."""
        from nightloom.finetune.base_model import base_source
        from nightloom.finetune.config import XTunerConfigError
        from nightloom.storage import S3Config

        src = base_source(self.spec)
        if not src.is_s3:
            return None
        endpoint = S3Config.from_spec(self.spec.storage).endpoint()
        path = ensure_node_models(self.provider, cluster, src.uri, endpoint, log=self.log)
        if self.base_path is not None and path != self.base_path:
            raise XTunerConfigError(f"model.weights: the new nodes cache {src.uri} at another path")
        self.base_path = path
        return path

    def ready(self, cluster: Cluster, plan: XTunerPlan) -> XTunerPlan:
        """`plan` for `cluster` after recovery: a new node must see the run folder, gets the env and the base
        model; the plan names each node's interpreter and where node_wrapper.py is there."""
        from nightloom.provision.shared_folder import check_shared_folder

        new = [n for n in cluster.nodes if n.name not in self.envs]
        if new:
            sub = cluster.model_copy(update={"nodes": new})
            check_shared_folder(self.provider, sub, self.run_dir)  # a spare must see the run folder as the others do
            self.ensure_envs(sub)
            if self.base_path is not None:
                self.ensure_model(sub)
        return self.for_nodes(cluster, plan)

    def for_nodes(self, cluster: Cluster, plan: XTunerPlan) -> XTunerPlan:
        pythons = {name: e.python for name, e in self.envs.items()}
        return plan.model_copy(update={"wrapper": wrapper_path(cluster), "node_pythons": pythons})


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


def node_peak(env: NodeEnv, precision: str = "auto"):
    """The MFU peak (nightloom.perf.Peak) of a GPU node: the catalog datasheet for the GPU it reports;
    XTunerConfigError when it reports none or one the catalog does not know."""
    from nightloom.finetune.config import XTunerConfigError
    from nightloom.perf import resolve_peak

    if not env.gpus:
        raise XTunerConfigError(f"node {env.node}: GPU profile but nvidia-smi reports no GPU: no peak for its MFU")
    return resolve_peak(catalog_gpu(env.gpus[0]), precision if precision != "auto" else "bf16")


def catalog_gpu(reported: str) -> str:
    """The catalog key of a GPU as a node reports it (nvidia-smi / torch: 'NVIDIA H100 80GB HBM3' ->
    'h100-80gb', 'NVIDIA GeForce RTX 4090' -> 'rtx-4090'), catalog aliases included. A GPU the catalog
    does not know is an error (its MFU would silently be missing), naming what is known."""
    from nightloom.catalog import GPU_ALIASES, GPUS
    from nightloom.finetune.config import XTunerConfigError

    words = [w for w in re.findall(r"[a-z0-9]+", reported.lower()) if w not in ("nvidia", "geforce", "tesla")]
    names = {**{k: k for k in GPUS}, **GPU_ALIASES}
    for n in ("-".join(words), "".join(words)):
        if n in names:
            return names[n]
    model = words[0] if words else ""
    mem = next((w for w in words if re.fullmatch(r"\d+gb", w)), None)
    same = sorted(
        k for k in GPUS if k.split("-")[0] == model and (mem is None or mem in k.split("-")[1:] or "-" not in k)
    )
    if mem is not None:  # a memory size is named: exactly one catalog entry of that model must have it
        if len(same) == 1:
            return same[0]
    else:
        for i in range(len(words) - 1, 0, -1):  # the longest known prefix: 'h100 pcie' -> alias 'h100'
            if "-".join(words[:i]) in names:
                return names["-".join(words[:i])]
        if len(same) == 1:
            return same[0]
    raise XTunerConfigError(
        f"node GPU {reported!r} is not in the catalog (known: {', '.join(sorted(GPUS))}; aliases: "
        f"{', '.join(sorted(GPU_ALIASES))}): no peak FLOP/s for its MFU; add it to nightloom/catalog.py"
    )
