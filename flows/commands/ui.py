"""`nightloom ui`: the Prefect UI for this checkout in one command.

Starts a Prefect server on 127.0.0.1 (telemetry off, its database under `.nightloom/prefect`), creates the
`local-pool` process work pool, registers every deployment of prefect.yaml (`prefect deploy --all`) and starts a
worker; prints the URL, then waits. Ctrl-C (or any of them exiting) stops the worker and the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from flows.defaults import set_prefect_defaults

POOL = "local-pool"  # the work pool prefect.yaml's deployments name


def register(sub) -> None:
    p = sub.add_parser(
        "ui",
        help="start a local Prefect server, the work pool, the deployments and a worker; Ctrl-C stops them",
    )
    p.add_argument("--port", type=int, default=4200, help="the server's port on 127.0.0.1 (default 4200)")
    p.add_argument(
        "--home",
        default=".nightloom/prefect",
        help="PREFECT_HOME: the server's database, settings and log (default .nightloom/prefect)",
    )
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the server (default 180)")
    p.set_defaults(func=run)


class UIError(RuntimeError):
    """A step of bringing the UI up failed; the message says which and where its output is."""


@dataclass
class Stack:
    """The processes `nightloom ui` started, stopped in reverse order (worker before server)."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str], log: Path | None) -> subprocess.Popen:
        out = open(log, "ab") if log else None  # noqa: SIM115 - the child keeps it; closed when the stack stops
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self.procs.append((name, proc))
        return proc

    def exited(self) -> str | None:
        """The name of the first process that is no longer running, if any."""
        return next((n for n, p in self.procs if p.poll() is not None), None)

    def stop(self) -> None:
        """Stop each process group in turn, last started first (the worker says goodbye to a server still up):
        SIGTERM, then SIGKILL after 15 s."""
        for _, proc in reversed(self.procs):
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def prefect_env(api_url: str, home: Path) -> dict[str, str]:
    """The environment of every process `nightloom ui` starts: this server, telemetry off, a quick worker."""
    env = dict(os.environ)
    env.update(
        PREFECT_API_URL=api_url,
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS=env.get("PREFECT_WORKER_QUERY_SECONDS", "2"),
        PYTHONUNBUFFERED="1",
    )
    set_prefect_defaults(env)  # the worker's flow runs (the deployments) inherit them: flows/defaults.py
    return env


def prefect_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", "--no-prompt", *args]


def step(name: str, argv: list[str], env: dict[str, str], log: Path) -> float:
    """Run one setup command to completion, its output appended to `log`; its wall time in seconds."""
    t0 = time.monotonic()
    with open(log, "ab") as out:
        rc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        raise UIError(f"{name} failed (exit {rc}); last lines of {log}:\n{tail(log)}")
    return time.monotonic() - t0


def bring_up(stack: Stack, root: Path, port: int, home: Path, timeout: float) -> str:
    """Server, work pool, deployments, worker; returns the UI's URL. Raises UIError naming the failed step."""
    url, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    if port_in_use(port):
        raise UIError(
            f"127.0.0.1:{port} is already in use (another Prefect server?); try another port: "
            f"make ui PORT={port + 1}, or .venv/bin/nightloom ui --port {port + 1}"
        )
    home.mkdir(parents=True, exist_ok=True)
    env, server_log, setup_log = prefect_env(api, home), home / "server.log", home / "setup.log"
    t0 = time.monotonic()
    print(f"starting the Prefect server on {url} (log: {server_log}) ...", flush=True)
    server = stack.start("server", prefect_cmd("server", "start", "--host", "127.0.0.1", "--port", str(port)),
                         env, server_log)  # fmt: skip
    while not healthy(api):
        if server.poll() is not None:
            raise UIError(f"the Prefect server exited ({server.returncode}); last lines of {server_log}:\n"
                          f"{tail(server_log)}")  # fmt: skip
        if time.monotonic() - t0 > timeout:
            raise UIError(f"the Prefect server was not healthy after {timeout:.0f} s; see {server_log}")
        time.sleep(0.3)
    print(f"server ready in {time.monotonic() - t0:.1f} s", flush=True)
    s = step("work-pool create", prefect_cmd("work-pool", "create", POOL, "--type", "process", "--overwrite"),
             env, setup_log)  # fmt: skip
    print(f"work pool {POOL} ready in {s:.1f} s", flush=True)
    s = step("prefect deploy --all", prefect_cmd("deploy", "--all"), env, setup_log)
    print(f"deployments of {root / 'prefect.yaml'} registered in {s:.1f} s", flush=True)
    stack.start("worker", prefect_cmd("worker", "start", "--pool", POOL), env, None)
    return url


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(args) -> int:
    root = Path.cwd()
    if not (root / "prefect.yaml").is_file():
        print(f"nightloom ui: no prefect.yaml in {root}; run it from the repository root", file=sys.stderr)
        return 2
    home = Path(args.home).expanduser().resolve()
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, or `kill` (also when started with SIGINT ignored: `&`)
        signal.signal(sig, _interrupt)
    stack = Stack()
    try:
        url = bring_up(stack, root, args.port, home, args.timeout)
        print(
            f"\nPrefect UI: {url}\n"
            f"  Run a training run: Deployments → training-pipeline/on-demand → Run → Custom run → Submit\n"
            f"  The worker's output (each run's logs) follows below; Ctrl-C stops the worker and the server.\n",
            flush=True,
        )
        while (gone := stack.exited()) is None:
            time.sleep(0.5)
        print(f"nightloom ui: the {gone} exited; stopping the rest", file=sys.stderr)
        return 1
    except UIError as e:
        print(f"nightloom ui: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping the worker and the server ...", file=sys.stderr)
        return 0
    finally:
        stack.stop()
