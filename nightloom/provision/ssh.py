"""The `ssh` provider: machines the user already rents, driven with asyncssh; host keys always verified.

Each node: connect (key from the caller — tasks/provision.py resolves a Prefect Secret — or the env var
`cluster.provider.key_env`, holding the key or a path to it), copy this nightloom package to
WORKDIR/.nightloom/code/HASH once (SFTP; that is how a real remote node gets the code), prepare the node
environment keyed by its requirements (node_agent.py), probe it (preflight) and run the all-reduce test.
Training runs as `torchrun` in a new session per node; its process-group id is written to
WORKDIR/.nightloom/pids/ so release — even from a fresh provider in a teardown hook — kills the whole tree.
asyncssh runs on a private event loop thread; the public methods are synchronous.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
import uuid
from pathlib import Path

import nightloom.provision.preflight as preflight
from nightloom.provision.base import (
    Cluster,
    MergedLaunch,
    Node,
    NodeReport,
    NodeRun,
    ProvisionError,
    torchrun_argv,
)
from nightloom.provision.nccl import render_nccl_env
from nightloom.provision.preflight import AgentPreflight, Expect
from nightloom.provision.shell import PGID_MARK, kill_pgids_command, plain_command, quote_path, session_command

log = logging.getLogger("nightloom.provision.ssh")


class _Loop:
    """An asyncio loop on a daemon thread; `run(coro)` from synchronous code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="nightloom-ssh", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def code_tree() -> tuple[Path, str]:
    """This nightloom package and a hash of its files (the remote copy's key)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return root, h.hexdigest()[:16]


def node_names(hosts) -> list[str]:
    """`host:port`, made unique with `#i` when the same endpoint is listed twice."""
    names, seen = [], set()
    for i, h in enumerate(hosts):
        name = f"{h.host}:{h.port}"
        if name in seen:
            name = f"{name}#{i}"
        seen.add(name)
        names.append(name)
    return names


class SSHLaunch(MergedLaunch):
    """One remote torchrun per node; output merged line by line; teardown by recorded process group."""

    def __init__(self, provider: SSHProvider, cluster: Cluster, tag: str, fail_grace_s: float):
        super().__init__(len(cluster.nodes), fail_grace_s)
        self.provider, self.cluster, self.tag = provider, cluster, tag
        self.pgids: dict[str, int] = {}
        self.codes: dict[str, int | None] = {n.name: None for n in cluster.nodes}
        self._done = threading.Event()
        self._terminated = False

    async def _run_node(self, node: Node, cmd: str) -> None:
        name = node.name
        try:
            conn = await self.provider._conn(node)
            import asyncssh

            async with conn.create_process(cmd, stderr=asyncssh.STDOUT) as proc:
                async for line in proc.stdout:
                    line = line.rstrip("\n")
                    if line.startswith(PGID_MARK + " ") and name not in self.pgids:
                        self.pgids[name] = int(line.split()[1])
                        continue
                    self._q.put(f"[{name}] {line}")
                await proc.wait()
                rc = proc.exit_status
                if rc is None:  # killed by a signal
                    rc = 128 + 15 if proc.exit_signal else 255
                self.codes[name] = rc
        except Exception as e:  # noqa: BLE001 - reported as this node's failure
            self._q.put(f"[{name}] nightloom: ssh launch failed: {self.provider._why(e)}")
            self.codes[name] = 255
        finally:
            self._q.put(None)

    def poll(self) -> dict[str, int | None]:
        return dict(self.codes)

    def terminate(self) -> None:
        """TERM then KILL every recorded process group of this launch on every node (idempotent)."""
        if self._terminated and all(c is not None for c in self.codes.values()):
            return
        self._terminated = True
        self.provider._kill(self.cluster, self.tag)


class SSHProvider(AgentPreflight):
    """Nodes are SSH hosts from `spec.cluster.provider.hosts`; spares replace unreachable hosts in acquire and
    failed nodes in reacquire."""

    name = "ssh"

    def __init__(
        self,
        spec,
        private_key: str | None = None,
        expect: Expect | None = None,
        connect_timeout_s: float = 10.0,
        command_timeout_s: float = 300.0,
    ):
        self.spec = spec
        self._private_key = private_key  # text; never logged, never put in an error
        self.expect = expect
        self.connect_timeout_s = connect_timeout_s
        self.command_timeout_s = command_timeout_s
        self._loop: _Loop | None = None
        self._conns: dict[str, object] = {}
        self._launch_no = 0
        self._nodes_by_name: dict[str, Node] = {}

    # ------------------------------------------------------------------------------------------ plumbing
    @property
    def loop(self) -> _Loop:
        if self._loop is None:
            self._loop = _Loop()
        return self._loop

    def _key(self):
        import asyncssh

        ssh = self.spec.cluster.provider
        text = self._private_key
        where = f"Prefect Secret {ssh.key_secret!r}" if text is not None and ssh.key_secret else "the given key"
        if text is None:
            raw = os.environ.get(ssh.key_env)
            if not raw:
                raise ProvisionError(
                    f"no SSH key: set cluster.provider.key_secret, or the env var {ssh.key_env} "
                    "(cluster.provider.key_env) to a private key or a key file path"
                )
            where = f"env var {ssh.key_env}"
            if "PRIVATE KEY" not in raw:
                path = Path(raw).expanduser()
                if not path.is_file():
                    raise ProvisionError(
                        f"{where} (cluster.provider.key_env) is neither a private key nor a file path that exists"
                    )
                try:
                    return asyncssh.read_private_key(str(path))
                except (asyncssh.KeyImportError, OSError) as e:
                    raise ProvisionError(f"SSH key file from {where} could not be read: {type(e).__name__}") from None
            text = raw
        try:
            return asyncssh.import_private_key(text)
        except (asyncssh.KeyImportError, ValueError) as e:
            raise ProvisionError(f"SSH private key from {where} could not be parsed: {type(e).__name__}") from None

    def _known_hosts(self) -> str:
        p = Path(self.spec.cluster.provider.known_hosts).expanduser()
        if not p.is_file():
            raise ProvisionError(
                f"cluster.provider.known_hosts: file not found: {p} (host keys are always verified; "
                "add the nodes' keys, e.g. with ssh-keyscan, after checking them)"
            )
        return str(p)

    def _why(self, e: BaseException) -> str:
        """A one-line reason for a connection error (never a secret)."""
        import asyncssh

        if isinstance(e, asyncssh.HostKeyNotVerifiable):
            return f"host key not verifiable against {self.spec.cluster.provider.known_hosts} (unknown or changed host key)"
        if isinstance(e, asyncssh.PermissionDenied):
            return "authentication failed: the key was refused (permission denied)"
        if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
            return f"unreachable: no answer within {self.connect_timeout_s:g} s"
        if isinstance(e, OSError):
            return f"unreachable: {e.strerror or e}"
        if isinstance(e, asyncssh.Error):
            return f"ssh error: {e.reason}"
        return f"{type(e).__name__}: {e}"

    async def _connect(self, host, key, known_hosts: str):
        import asyncssh

        return await asyncio.wait_for(
            asyncssh.connect(
                host.host,
                port=host.port,
                username=host.user,
                client_keys=[key],
                known_hosts=known_hosts,
                agent_path=None,
                connect_timeout=self.connect_timeout_s,
            ),
            self.connect_timeout_s + 2,
        )

    async def _conn(self, node: Node):
        conn = self._conns.get(node.name)
        if conn is None or conn.is_closed():
            import asyncssh

            conn = await asyncio.wait_for(
                asyncssh.connect(
                    node.address,
                    port=node.port or 22,
                    username=node.user,
                    client_keys=[self._key()],
                    known_hosts=self._known_hosts(),
                    agent_path=None,
                    connect_timeout=self.connect_timeout_s,
                ),
                self.connect_timeout_s + 2,
            )
            self._conns[node.name] = conn
        return conn

    async def _run(self, node: Node, cmd: str, timeout: float | None = None) -> tuple[int, str]:
        import asyncssh

        conn = await self._conn(node)
        r = await asyncio.wait_for(
            conn.run(cmd, check=False, stderr=asyncssh.STDOUT), timeout or self.command_timeout_s
        )
        return (r.exit_status if r.exit_status is not None else 255), (r.stdout or "")

    async def _agent(self, node: Node, python: str, cmd: str, args: dict) -> dict:
        rc, out = await self._run(node, plain_command(preflight.agent_argv(python, cmd, args)))
        if rc == 127 or "not found" in out and "NIGHTLOOM_JSON" not in out:
            raise ProvisionError(
                f"node {node.name}: interpreter {python!r} not found (cluster.provider.hosts[].python)"
            )
        return preflight.parse_agent_output(node.name, out)

    # ------------------------------------------------------------------------------------------ acquire
    def acquire(self) -> Cluster:
        """Connect, sync code, prepare environments, preflight; failing nodes are excluded with a reason."""
        t0 = time.monotonic()
        cluster = self.loop.run(self._acquire())
        report = self.last_report = self.preflight(cluster)
        try:
            preflight.apply_preflight(cluster, report, self.spec.cluster.min_nodes or self.spec.cluster.nodes)
        except ProvisionError:
            self.release(cluster)
            raise
        cluster.time_to_ready_s = time.monotonic() - t0
        return cluster

    async def _acquire(self) -> Cluster:
        c = self.spec.cluster
        if not c.provider.hosts:
            raise ProvisionError("cluster.provider.hosts: no hosts given")
        if len(c.provider.hosts) < (c.min_nodes or c.nodes):
            raise ProvisionError(
                f"cluster.provider.hosts: {len(c.provider.hosts)} host(s) listed but cluster.nodes="
                f"{c.nodes} (min_nodes={c.min_nodes or c.nodes}): too few nodes"
            )
        env = {"OMP_NUM_THREADS": "1", **render_nccl_env(c.nccl)}
        key, known = self._key(), self._known_hosts()
        names = node_names(c.provider.hosts)
        active = [(n, h) for n, h in zip(names, c.provider.hosts) if not h.spare]
        spares = [(n, h) for n, h in zip(names, c.provider.hosts) if h.spare] + active[c.nodes :]
        active = active[: c.nodes]
        failures: dict[str, str] = {}

        async def try_connect(name, host):
            try:
                self._conns[name] = await self._connect(host, key, known)
                return True
            except Exception as e:  # noqa: BLE001 - named below
                failures[name] = self._why(e)
                return False

        oks = await asyncio.gather(*(try_connect(n, h) for n, h in active))
        chosen = [(n, h) for (n, h), ok in zip(active, oks) if ok]
        for n, h in spares:
            if len(chosen) >= c.nodes:
                break
            if await try_connect(n, h):
                chosen.append((n, h))
        min_nodes = c.min_nodes or c.nodes
        if len(chosen) < min_nodes:
            await self._close()
            why = "; ".join(f"node {n}: {r}" for n, r in failures.items())
            raise ProvisionError(f"ssh: {len(chosen)} of {c.nodes} nodes reachable (need {min_nodes}): {why}")
        cluster_id = uuid.uuid4().hex[:12]
        code_root, code_key = code_tree()
        req_failures: dict[str, str] = {}

        async def ready(name, host) -> Node | None:
            try:
                return await self._ready(name, host, code_root, code_key)
            except Exception as e:  # noqa: BLE001 - the node is excluded with this reason
                req_failures[name] = str(e) if isinstance(e, ProvisionError) else self._why(e)
                return None

        nodes = [n for n in await asyncio.gather(*(ready(n, h) for n, h in chosen)) if n is not None]
        failures.update(req_failures)
        if len(nodes) < min_nodes:
            await self._close()
            why = "; ".join(f"node {n}: {r}" for n, r in failures.items())
            raise ProvisionError(f"ssh: {len(nodes)} of {c.nodes} nodes prepared (need {min_nodes}): {why}")
        for n in nodes:
            self._nodes_by_name[n.name] = n
        return Cluster(
            provider="ssh",
            name=c.name,
            nodes=nodes,
            master_addr=nodes[0].address,
            master_port=c.master_port,
            env=env,
            excluded=dict(failures),
            handle={"cluster_id": cluster_id, "code_key": code_key},
        )

    async def _ready(self, name: str, host, code_root: Path, code_key: str) -> Node:
        """Prepare a connected host's environment (keyed by the requirements) and copy the code to it."""
        c = self.spec.cluster
        n0 = time.monotonic()
        node = Node(
            name=name,
            address=host.host,
            port=host.port,
            user=host.user,
            slots=host.gpus,
            python=host.python,
            workdir=host.workdir,
        )
        info = await self._agent(
            node,
            host.python,
            "prepare",
            {
                "workdir": host.workdir,
                "key": preflight.env_key(host.python, c.env_requirements),
                "requirements": c.env_requirements,
            },
        )
        node.workdir, node.python = info["workdir"], info["python"]
        await self._sync_code(node, code_root, code_key)
        node.ready_s = time.monotonic() - n0
        log.info("node %s ready in %.2f s (%s env)", name, node.ready_s, "warm" if info.get("warm") else "cold")
        return node

    # ------------------------------------------------------------------------------------------ recovery
    def reacquire(self, cluster: Cluster, exclude: dict[str, str]) -> Cluster:
        """The cluster without `exclude` (name -> reason), topped up to cluster.nodes from hosts not used yet
        (`spare: true` ones first, then any listed beyond cluster.nodes); each candidate is connected, prepared
        and preflighted before it joins, and one that fails is excluded with its reason."""
        c = self.spec.cluster
        keep = [n for n in cluster.nodes if n.name not in exclude]
        excluded = {**cluster.excluded, **exclude}
        used = {n.name for n in cluster.nodes} | set(excluded)
        listed = list(zip(node_names(c.provider.hosts), c.provider.hosts))
        candidates = [(n, h) for n, h in listed if h.spare and n not in used]
        candidates += [(n, h) for n, h in listed if not h.spare and n not in used]
        if len(keep) < c.nodes and candidates:
            code_root, code_key = code_tree()
            key, known = self._key(), self._known_hosts()
            for name, host in candidates:
                if len(keep) >= c.nodes:
                    break
                try:
                    self._conns[name] = self.loop.run(self._connect(host, key, known))
                    node = self.loop.run(self._ready(name, host, code_root, code_key))
                except Exception as e:  # noqa: BLE001 - the spare is excluded with this reason
                    excluded[name] = str(e) if isinstance(e, ProvisionError) else self._why(e)
                    continue
                report = self.preflight(cluster.model_copy(update={"nodes": [node], "master_addr": node.address}))
                if report.failed:
                    excluded[name] = report.failed[0].reason
                    continue
                log.info("spare node %s joins the cluster", name)
                self._nodes_by_name[name] = node
                keep.append(node)
        master = keep[0].address if keep and cluster.master_addr not in {n.address for n in keep} else None
        return cluster.model_copy(
            deep=True, update={"nodes": keep, "excluded": excluded, "master_addr": master or cluster.master_addr}
        )

    async def _sync_code(self, node: Node, code_root: Path, code_key: str) -> None:
        """Copy the nightloom package to WORKDIR/.nightloom/code/KEY once (atomic rename; skipped when warm)."""
        dest = f"{node.workdir}/.nightloom/code/{code_key}"
        rc, _ = await self._run(node, plain_command(["test", "-f", f"{dest}/.complete"]))
        if rc == 0:
            return
        tmp = f"{dest}.tmp{uuid.uuid4().hex[:6]}"
        await self._run(node, plain_command(["mkdir", "-p", tmp]))
        conn = await self._conn(node)
        async with conn.start_sftp_client() as sftp:
            await sftp.put(str(code_root), f"{tmp}/nightloom", recurse=True)
        rc, out = await self._run(
            node,
            plain_command(["touch", f"{tmp}/.complete"])
            + " && "
            + plain_command(["mv", "-T", tmp, dest])
            + " || "
            + plain_command(["rm", "-rf", tmp]),
        )
        if rc != 0:
            raise ProvisionError(f"node {node.name}: could not install code at {dest}: {out.strip()[-200:]}")

    # ------------------------------------------------------------------------------------------ preflight
    def probe_nodes(self, cluster: Cluster, expect: Expect) -> list[NodeReport]:
        """The node agent's probe on every node at once (one connection each), judged against `expect`."""
        return self.loop.run(self._probe_all(cluster, expect))

    async def _probe_all(self, cluster: Cluster, expect: Expect) -> list[NodeReport]:
        async def one(node: Node) -> NodeReport:
            try:
                t_a = time.time()
                out = await self._agent(node, node.python, "probe", {"workdir": node.workdir})
                t_b = time.time()
            except Exception as e:  # noqa: BLE001 - the node fails preflight with this reason
                why = str(e) if isinstance(e, ProvisionError) else self._why(e)
                return preflight.unreachable(node.name, why)
            return preflight.evaluate(node.name, out, expect, t_a, t_b)

        return list(await asyncio.gather(*(one(n) for n in cluster.nodes)))

    # ------------------------------------------------------------------------------------------ launch
    def launch(self, cluster: Cluster, module_args: list[str], env: dict[str, str]) -> SSHLaunch:
        self._launch_no += 1
        cid = cluster.handle.get("cluster_id", "adhoc")
        tag = f"{cid}.{self._launch_no}."
        launch = SSHLaunch(self, cluster, tag, fail_grace_s=float(self.spec.train.collective_timeout_s) + 30)
        cmds = self.loop.run(self._commands(cluster, module_args, env, tag))
        for node, cmd in zip(cluster.nodes, cmds):
            asyncio.run_coroutine_threadsafe(launch._run_node(node, cmd), self.loop.loop)
        return launch

    async def _commands(self, cluster: Cluster, module_args: list[str], env: dict[str, str], tag: str) -> list[str]:
        cmds = []
        cid = cluster.handle.get("cluster_id", "adhoc")
        code_key = cluster.handle.get("code_key")
        for i, node in enumerate(cluster.nodes):
            args = await self._stage_job_file(node, module_args, cid)
            full_env = {**cluster.env, **env, "PYTHONUNBUFFERED": "1"}
            if code_key:
                full_env["PYTHONPATH"] = f"{node.workdir}/.nightloom/code/{code_key}"
            pid_dir = f"{node.workdir}/.nightloom/pids"
            await self._run(node, plain_command(["mkdir", "-p", pid_dir]))
            argv = torchrun_argv(node.python, cluster, i, args)
            cmds.append(session_command(node.workdir, argv, full_env, pgid_file=f"{pid_dir}/{tag}{i}.pgid"))
        return cmds

    def run_on(
        self, cluster: Cluster, node: Node, argv: list[str], env: dict[str, str], timeout_s: float = 3600.0
    ) -> NodeRun:
        """`argv` on `node` in its workdir, the synced code on PYTHONPATH, as a new session whose process group
        is recorded under the cluster's tag (release kills it); killed on timeout. Output: stdout + stderr."""
        self._launch_no += 1
        cid = cluster.handle.get("cluster_id", "adhoc")
        tag = f"{cid}.{self._launch_no}."
        full_env = {**cluster.env, **env, "PYTHONUNBUFFERED": "1"}
        if cluster.handle.get("code_key"):
            full_env["PYTHONPATH"] = f"{node.workdir}/.nightloom/code/{cluster.handle['code_key']}"
        pid_dir = f"{node.workdir}/.nightloom/pids"
        t0 = time.monotonic()

        async def go() -> tuple[int, str]:
            await self._run(node, plain_command(["mkdir", "-p", pid_dir]))
            cmd = session_command(node.workdir, argv, full_env, pgid_file=f"{pid_dir}/{tag}0.pgid")
            return await self._run(node, cmd, timeout=timeout_s)

        try:
            rc, out = self.loop.run(go())
        except BaseException:  # timeout, or the caller was cancelled: nothing of ours stays running
            self._kill(cluster.model_copy(update={"nodes": [node]}), tag)
            raise
        out = "\n".join(x for x in out.splitlines() if not x.startswith(PGID_MARK + " "))
        return NodeRun(node=node.name, code=rc, output=out, seconds=time.monotonic() - t0)

    async def _stage_job_file(self, node: Node, module_args: list[str], cid: str) -> list[str]:
        """`--job LOCAL.json` → copied to WORKDIR/.nightloom/jobs/CLUSTER/ on the node, the argument rewritten."""
        args = list(module_args)
        if "--job" in args and args.index("--job") + 1 < len(args):
            i = args.index("--job") + 1
            local = Path(args[i])
            if local.is_file():
                remote_dir = f"{node.workdir}/.nightloom/jobs/{cid}"
                await self._run(node, plain_command(["mkdir", "-p", remote_dir]))
                conn = await self._conn(node)
                async with conn.start_sftp_client() as sftp:
                    await sftp.put(str(local), f"{remote_dir}/{local.name}")
                args[i] = f"{remote_dir}/{local.name}"
        return args

    # ------------------------------------------------------------------------------------------ teardown
    def _kill(self, cluster: Cluster, tag: str, grace_s: float = 5.0) -> list[str]:
        """TERM, wait, KILL the process groups recorded under `tag`; returns the nodes that failed to answer."""
        return self.loop.run(self._kill_async(cluster, tag, grace_s))

    async def _kill_async(self, cluster: Cluster, tag: str, grace_s: float) -> list[str]:
        unreachable: list[str] = []

        async def one(node: Node) -> None:
            pid_dir = f"{node.workdir}/.nightloom/pids"
            try:
                await self._run(node, kill_pgids_command(pid_dir, tag, "TERM"), timeout=30)
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline:
                    _, out = await self._run(node, kill_pgids_command(pid_dir, tag, "0"), timeout=30)
                    if "alive" not in out:
                        break
                    await asyncio.sleep(0.3)
                await self._run(node, kill_pgids_command(pid_dir, tag, "KILL"), timeout=30)
                await self._run(node, f"rm -f {quote_path(pid_dir)}/{tag}*.pgid", timeout=30)
            except Exception as e:  # noqa: BLE001 - reported, teardown goes on with the other nodes
                unreachable.append(f"{node.name}: {self._why(e)}")

        await asyncio.gather(*(one(n) for n in cluster.nodes))
        for u in unreachable:
            log.warning("teardown could not reach node %s", u)
        return unreachable

    def release(self, cluster: Cluster) -> None:
        """Kill every process group this cluster started on every node, then disconnect (idempotent)."""
        cid = cluster.handle.get("cluster_id")
        if cid:
            self._kill(cluster, f"{cid}.")
        if self._loop is not None:
            self.loop.run(self._close())
            self._loop.close()
            self._loop = None

    async def _close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
