"""The `slurm` provider: an `sbatch` allocation of N nodes whose script runs each launch as `srun` + torchrun.

acquire: check the partition and its size, `sbatch` the allocation script (job id kept in Cluster.handle),
wait for RUNNING, prepare and probe every node with `srun --overlap -w NODE` (one step each).
launch: write STATE/launch-K.sh (torchrun, rendezvous on the first node, node rank = $SLURM_NODEID); the
batch script picks it up and runs it with `srun --label` over the healthy nodes; output is streamed from
STATE/launch-K.out. release: `scancel` and wait until the job has left the queue (idempotent).
STATE is a folder on the file system the nodes share (spec.storage.root/slurm/...), as on any Slurm cluster.
Every command is an argument list (subprocess without a shell); scripts quote each value with shlex.quote.
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel

import nightloom.provision.preflight as preflight
from nightloom.provision.base import (
    Cluster,
    Node,
    NodeReport,
    NodeRun,
    ProvisionError,
    torchrun_argv,
)
from nightloom.provision.nccl import render_nccl_env
from nightloom.provision.preflight import AgentPreflight, Expect
from nightloom.provision.shell import env_argv
from nightloom.util import atomic_write_text

log = logging.getLogger("nightloom.provision.slurm")
_SBATCH_OPT = re.compile(r"--[a-z][a-z-]*(=[A-Za-z0-9_.,:=/@+-]+)?")
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class SlurmJobState(BaseModel):
    """A job's state as Slurm reports it (sacct when accounting is on, else scontrol)."""

    job_id: str
    state: str
    exit_code: str = ""
    reason: str = ""
    source: str = ""


def run_cmd(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ProvisionError(f"slurm: command {argv[0]!r} not found (is the Slurm client installed?)") from None


def job_state(job_id: str) -> SlurmJobState:
    """State of a job: `sacct` first (accounting), then `scontrol show job` (kept MinJobAge after the end)."""
    r = run_cmd(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State,ExitCode,Reason"])
    if r.returncode == 0 and r.stdout.strip():
        jid, state, code, reason = (r.stdout.strip().splitlines()[0].split("|") + ["", "", "", ""])[:4]
        return SlurmJobState(job_id=job_id, state=state.split()[0], exit_code=code, reason=reason, source="sacct")
    r = run_cmd(["scontrol", "show", "job", "-o", job_id])
    if r.returncode == 0:
        f = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)
        return SlurmJobState(
            job_id=job_id,
            state=f.get("JobState", "UNKNOWN"),
            exit_code=f.get("ExitCode", ""),
            reason=f.get("Reason", ""),
            source="scontrol",
        )
    return SlurmJobState(job_id=job_id, state="UNKNOWN", reason=(r.stderr or r.stdout).strip()[-200:], source="none")


def queued(job_id: str) -> str | None:
    """The job's state while it is in the queue (PENDING/RUNNING/COMPLETING...), None once it left it."""
    r = run_cmd(["squeue", "-h", "-j", job_id, "-o", "%T"])
    out = r.stdout.strip()
    return out.splitlines()[0] if r.returncode == 0 and out else None


def render_batch_script(spec, state_dir: str, avoid: list[str] | None = None, min_nodes: int | None = None) -> str:
    """The allocation script: run each launch-K.sh the orchestrator drops as one srun step, until released.
    `avoid`: nodes that failed in this run (added to cluster.provider.exclude); `min_nodes`: accept an allocation
    of min_nodes..nodes nodes (recovery takes what the partition has left rather than waiting for a full one)."""
    c, s = spec.cluster, spec.cluster.provider
    size = f"{min_nodes}-{c.nodes}" if min_nodes is not None and min_nodes < c.nodes else f"{c.nodes}"
    opts = [
        f"--job-name=nightloom-{spec.name}",
        f"--partition={s.partition}",
        f"--nodes={size}",
        "--ntasks-per-node=1",
        f"--time={s.time_limit}",
        f"--output={state_dir}/batch-%j.out",
        # the preemption notice to the steps' torchrun (which passes it to the ranks: save, stop) before the limit
        f"--signal={(spec.recovery.preempt_signal or 'SIGTERM').removeprefix('SIG')}@{spec.recovery.preempt_grace_s}",
    ]
    if c.gpu_type != "cpu":
        opts.append(f"--gpus-per-node={c.gpus_per_node}")
    if s.account:
        opts.append(f"--account={s.account}")
    bad = [n for n in s.exclude if not _NODE.fullmatch(n)]
    if bad:
        raise ProvisionError(f"cluster.provider.exclude: not node names: {bad}")
    exclude = list(dict.fromkeys([*s.exclude, *(n for n in (avoid or []) if _NODE.fullmatch(n))]))
    if exclude:
        opts.append("--exclude=" + ",".join(exclude))
    for i, o in enumerate(s.extra_sbatch):
        if not _SBATCH_OPT.fullmatch(o):
            raise ProvisionError(
                f"cluster.provider.extra_sbatch[{i}]: {o!r} is not a single --option[=value] "
                "(letters, digits and _.,:=/@+- only)"
            )
        opts.append(o)
    for o in opts:
        if "\n" in o:
            raise ProvisionError(f"slurm option with a newline: {o!r}")
    q = shlex.quote(state_dir)
    return "\n".join(
        [
            "#!/bin/bash",
            *(f"#SBATCH {o}" for o in opts),
            "set -u",
            f"state={q}",
            'scontrol show hostnames "$SLURM_JOB_NODELIST" > "$state/nodes.tmp" && mv "$state/nodes.tmp" "$state/nodes"',
            "k=1",
            "while true; do",
            '  if [ -f "$state/launch-$k.sh" ]; then',
            '    . "$state/launch-$k.env"   # NL_N, NL_NODES: the healthy nodes (written by the orchestrator)',
            '    srun --label --kill-on-bad-exit=1 -N "$NL_N" -n "$NL_N" --ntasks-per-node=1 -w "$NL_NODES" \\',
            '      bash "$state/launch-$k.sh" > "$state/launch-$k.out" 2>&1',
            '    echo $? > "$state/launch-$k.rc.tmp"; mv "$state/launch-$k.rc.tmp" "$state/launch-$k.rc"',
            "    k=$((k+1))",
            '  elif [ -f "$state/release" ]; then exit 0',
            "  else sleep 0.2; fi",
            "done",
            "",
        ]
    )


class SlurmLaunch:
    """One srun step inside the allocation; its output file is tailed; terminate cancels the step only."""

    def __init__(self, cluster: Cluster, k: int, state: Path, fail_grace_s: float):
        self.cluster, self.k, self.state, self.fail_grace_s = cluster, k, state, fail_grace_s
        self.job_id = cluster.handle["job_id"]
        self.out = state / f"launch-{k}.out"
        self.rc_file = state / f"launch-{k}.rc"
        self._rc: int | None = None

    def _finished(self) -> int | None:
        if self._rc is None and self.rc_file.is_file():
            text = self.rc_file.read_text().strip()
            self._rc = int(text) if text.lstrip("-").isdigit() else 1
        if self._rc is None and queued(self.job_id) is None:
            self._rc = 1  # the allocation itself ended (cancelled, time limit, node failure)
        return self._rc

    @property
    def pids(self) -> list[int]:
        """No local processes: the step runs on the allocation's nodes (scancel kills it)."""
        return []

    def poll(self) -> dict[str, int | None]:
        """One srun step spans every node: they share its exit code."""
        rc = self._finished()
        return {n.name: rc for n in self.cluster.nodes}

    def lines(self) -> Iterator[str]:
        names = [n.name for n in self.cluster.nodes]
        pos, buf = 0, ""
        while True:
            done = self._finished() is not None
            if self.out.is_file():
                with open(self.out, encoding="utf-8", errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                buf += chunk
                *full, buf = buf.split("\n")
                for line in full:
                    m = re.match(r"\s*(\d+): ?(.*)", line)
                    if m and int(m.group(1)) < len(names):
                        yield f"[{names[int(m.group(1))]}] {m.group(2)}"
                    else:
                        yield f"[slurm] {line}"
            if done:
                if buf:
                    yield f"[slurm] {buf}"
                return
            time.sleep(0.2)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self._finished()) is None:
            if deadline is not None and time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(f"slurm job {self.job_id} launch {self.k} did not finish within {timeout} s")
            time.sleep(0.2)
        return rc

    def steps(self) -> list[str]:
        r = run_cmd(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i"])
        return [
            s
            for s in r.stdout.split()
            if s.startswith(f"{self.job_id}.") and not s.endswith(".batch") and not s.endswith(".extern")
        ]

    def terminate(self) -> None:
        """Cancel this launch's step (the allocation stays for release); idempotent."""
        if self._finished() is not None:
            return
        deadline = time.monotonic() + 60
        while self._finished() is None and time.monotonic() < deadline:
            for step in self.steps():
                run_cmd(["scancel", step])
            time.sleep(0.5)


class SlurmProvider(AgentPreflight):
    """Nodes are the allocation of one sbatch job in `spec.cluster.provider.partition`."""

    name = "slurm"

    def __init__(
        self,
        spec,
        expect: Expect | None = None,
        python: str | None = None,
        start_timeout_s: float = 120.0,
        state_root: str | None = None,
    ):
        self.spec = spec
        self.expect = expect
        self.python = python or spec.cluster.provider.python or sys.executable  # on the shared file system
        self.start_timeout_s = start_timeout_s
        self.state_root = Path(state_root or Path(spec.storage.root) / "slurm")

    # ------------------------------------------------------------------------------------------ acquire
    def check_partition(self) -> None:
        c = self.spec.cluster
        part = c.provider.partition
        r = run_cmd(["scontrol", "show", "partition", "-o", part])
        if r.returncode != 0 or not r.stdout.strip():
            avail = run_cmd(["sinfo", "-h", "-o", "%R"]).stdout.split()
            raise ProvisionError(
                f"cluster.provider.partition: partition {part!r} not found; available: "
                f"{', '.join(sorted(set(avail))) or 'none (is slurmctld reachable?)'}"
            )
        f = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)
        total = int(f.get("TotalNodes", "0"))
        if total < c.nodes:
            raise ProvisionError(
                f"cluster.nodes: {c.nodes} nodes requested but partition {part!r} has {total} ({f.get('Nodes', '?')})"
            )

    def acquire(self) -> Cluster:
        self.check_partition()
        c = self.spec.cluster
        return self._allocate(avoid=[], min_nodes=c.min_nodes or c.nodes, flexible=False)

    def reacquire(self, cluster: Cluster, exclude: dict[str, str]) -> Cluster:
        """Recovery: release the allocation that holds the failed nodes (they stop billing), then ask Slurm
        for a new one that excludes every node that failed in this run, taking min_nodes..nodes nodes so a
        partition with no replacement left still lets the run go on smaller (re-planned by the caller)."""
        c = self.spec.cluster
        if not exclude:  # a transient failure: the same allocation and nodes serve the relaunch
            return cluster.model_copy(deep=True)
        failed = {**cluster.excluded, **exclude}
        self.release(cluster)
        new = self._allocate(avoid=sorted(failed), min_nodes=c.min_nodes or 1, flexible=True)
        new.excluded = {**failed, **new.excluded}
        log.info(
            "slurm: new allocation %s on %s (excluding %s)",
            new.handle["job_id"],
            ", ".join(n.name for n in new.nodes),
            ", ".join(sorted(failed)) or "none",
        )
        return new

    def _allocate(self, avoid: list[str], min_nodes: int, flexible: bool) -> Cluster:
        """sbatch an allocation, wait for it, prepare and preflight its nodes (released on any failure)."""
        t0 = time.monotonic()
        c = self.spec.cluster
        env = {"OMP_NUM_THREADS": "1", **render_nccl_env(c.nccl)}
        state = self.state_root / f"{self.spec.name}-{uuid.uuid4().hex[:8]}"
        state.mkdir(parents=True, exist_ok=True)
        script = state / "allocation.sbatch"
        atomic_write_text(script, render_batch_script(self.spec, str(state), avoid, min_nodes if flexible else None))
        r = run_cmd(["sbatch", "--parsable", str(script)])
        if r.returncode != 0:
            raise ProvisionError(
                f"slurm: sbatch refused the allocation ({c.nodes} nodes in partition "
                f"{c.provider.partition!r}): {r.stderr.strip()[-300:]}"
            )
        job_id = r.stdout.strip().split(";")[0]
        cluster = Cluster(
            provider="slurm",
            name=c.name,
            nodes=[],
            master_addr="",
            master_port=c.master_port,
            env=env,
            handle={"job_id": job_id, "state_dir": str(state)},
        )
        try:
            nodes = self._wait_running(job_id, state)
            cluster.nodes = self._prepare(job_id, nodes)
            cluster.master_addr = cluster.nodes[0].address
            report = self.last_report = self.preflight(cluster)
            preflight.apply_preflight(cluster, report, min_nodes)
        except BaseException:
            self.release(cluster)
            raise
        cluster.time_to_ready_s = time.monotonic() - t0
        return cluster

    def _wait_running(self, job_id: str, state: Path) -> list[str]:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            st = queued(job_id)
            if st == "RUNNING" and (state / "nodes").is_file():
                nodes = (state / "nodes").read_text().split()
                if nodes:
                    return nodes
            if st is None:
                js = job_state(job_id)
                raise ProvisionError(f"slurm job {job_id} ended before it ran: {js.state} {js.reason}")
            if time.monotonic() > deadline:
                js = job_state(job_id)
                raise ProvisionError(
                    f"slurm job {job_id} not running after {self.start_timeout_s:g} s: {js.state} (reason: {js.reason})"
                )
            time.sleep(0.2)

    def _srun_on(self, job_id: str, node: str, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        return run_cmd(
            ["srun", f"--jobid={job_id}", "--overlap", "-N1", "-n1", "-w", node, "--immediate=30", *argv],
            timeout=timeout,
        )

    def _prepare(self, job_id: str, names: list[str]) -> list[Node]:
        c = self.spec.cluster
        key = preflight.env_key(self.python, c.env_requirements)
        nodes = []
        for name in names:
            n0 = time.monotonic()
            prepare = {"workdir": str(Path.cwd()), "key": key, "requirements": c.env_requirements}
            r = self._srun_on(job_id, name, preflight.agent_argv(self.python, "prepare", prepare))
            info = preflight.parse_agent_output(name, r.stdout + r.stderr)
            nodes.append(
                Node(
                    name=name,
                    address=name,
                    slots=c.gpus_per_node,
                    python=info["python"],
                    workdir=info["workdir"],
                    ready_s=time.monotonic() - n0,
                )
            )
            log.info("node %s ready in %.2f s (%s env)", name, nodes[-1].ready_s, "warm" if info["warm"] else "cold")
        return nodes

    # ------------------------------------------------------------------------------------------ preflight
    def probe_nodes(self, cluster: Cluster, expect: Expect) -> list[NodeReport]:
        """The node agent's probe as one `srun` step per node inside the allocation (16 at a time), judged
        against `expect`."""
        job_id = cluster.handle["job_id"]

        def probe(node: Node) -> NodeReport:
            t_a = time.time()
            r = self._srun_on(job_id, node.name, preflight.agent_argv(node.python, "probe", {"workdir": node.workdir}))
            t_b = time.time()
            try:
                return preflight.evaluate(
                    node.name, preflight.parse_agent_output(node.name, r.stdout + r.stderr), expect, t_a, t_b
                )
            except ProvisionError as e:
                return preflight.unreachable(node.name, str(e))

        with ThreadPoolExecutor(max_workers=min(16, len(cluster.nodes) or 1)) as pool:
            return list(pool.map(probe, cluster.nodes))

    def run_on(
        self, cluster: Cluster, node: Node, argv: list[str], env: dict[str, str], timeout_s: float = 3600.0
    ) -> NodeRun:
        """`argv` as one `srun --overlap` step on `node` inside the allocation, in the node's workdir (the job's
        environment carries the code path); scancel of the allocation (release) ends it."""
        full_env = {**cluster.env, **env, "PYTHONUNBUFFERED": "1"}
        t0 = time.monotonic()
        r = run_cmd(
            [
                "srun",
                f"--jobid={cluster.handle['job_id']}",
                "--overlap",
                "-N1",
                "-n1",
                "-w",
                node.name,
                "--immediate=30",
                f"--chdir={node.workdir}",
                *env_argv(full_env),
                *argv,
            ],
            timeout=timeout_s,
        )
        return NodeRun(node=node.name, code=r.returncode, output=r.stdout + r.stderr, seconds=time.monotonic() - t0)

    # ------------------------------------------------------------------------------------------ launch
    def launch(self, cluster: Cluster, module_args: list[str], env: dict[str, str]) -> SlurmLaunch:
        state = Path(cluster.handle["state_dir"])
        k = len(list(state.glob("launch-*.sh"))) + 1  # the allocation's script runs launch-1, -2, ... in order
        if queued(cluster.handle["job_id"]) != "RUNNING":
            raise ProvisionError(
                f"slurm job {cluster.handle['job_id']} is not running "
                f"({job_state(cluster.handle['job_id']).state}); cannot launch"
            )
        node0 = cluster.nodes[0]
        argv = torchrun_argv(node0.python, cluster, 0, module_args)
        full_env = {**cluster.env, **env, "PYTHONUNBUFFERED": "1"}
        words = [shlex.quote(a) for a in [*env_argv(full_env), *argv]]
        words = ['--node-rank="$SLURM_NODEID"' if w == "--node-rank=0" else w for w in words]
        script = "\n".join(["#!/bin/bash", f"cd {shlex.quote(node0.workdir)} || exit 1", "exec " + " ".join(words), ""])
        names = [n.name for n in cluster.nodes]
        for n in names:
            if not _NODE.fullmatch(n):
                raise ProvisionError(f"slurm node name {n!r} is not a plain host name")
        atomic_write_text(state / f"launch-{k}.env", f"NL_N={len(names)}\nNL_NODES={','.join(names)}\n")
        atomic_write_text(state / f"launch-{k}.sh", script)  # last: the batch script starts on this file
        return SlurmLaunch(cluster, k, state, fail_grace_s=float(self.spec.train.collective_timeout_s) + 30)

    # ------------------------------------------------------------------------------------------ release
    def release(self, cluster: Cluster, timeout_s: float = 60.0) -> None:
        """scancel the allocation and wait until it has left the queue (idempotent)."""
        job_id = cluster.handle.get("job_id")
        if not job_id:
            return
        state = cluster.handle.get("state_dir")
        if state and Path(state).is_dir():
            (Path(state) / "release").touch()
        deadline = time.monotonic() + timeout_s
        while queued(job_id) is not None:
            run_cmd(["scancel", job_id])
            if time.monotonic() > deadline:
                raise ProvisionError(f"slurm job {job_id} still in the queue {timeout_s:g} s after scancel")
            time.sleep(0.3)
        log.info("slurm job %s released: %s", job_id, job_state(job_id).state)
