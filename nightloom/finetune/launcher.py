"""Build and run the XTuner launch commands: the env's interpreter running node_wrapper.py, one rank or torchrun.

Never the `xtuner` CLI: it exits 0 when training crashes and takes `python`/`torchrun` from PATH. Output is
streamed line by line to a log callback and kept in full in a log file (a rare gloo SIGABRT was once lost
to a truncated stderr).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

WRAPPER = Path(__file__).resolve().parent / "node_wrapper.py"
OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


class XTunerLaunchError(RuntimeError):
    """A launched XTuner step failed; names the step, the exit code and the full log file."""

    code: int | None = None  # the exit code, when the step exited


@dataclass(frozen=True)
class Command:
    """One command to run on a node: argv plus the environment additions it needs."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def node_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment every XTuner process gets: one thread per rank, unbuffered, offline-friendly checkpoint loads."""
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # offline mode travels with the run to remote nodes (an ssh login does not inherit it)
        **{k: os.environ[k] for k in OFFLINE_FLAGS if k in os.environ},
    }
    env.update(extra or {})
    return env


def wrapper_args(mode: str, *args: str, wrapper: str | Path = WRAPPER) -> list[str]:
    """`node_wrapper.py MODE ARGS...` (what torchrun or a provider runs after its own options); `wrapper`: the
    script's path as the node running it sees it."""
    return [str(wrapper), mode, *map(str, args)]


def train_args(
    config: Path,
    *,
    distributed: bool,
    resume: Path | None = None,
    deepspeed: str | None = None,
    wrapper: str | Path = WRAPPER,
) -> list[str]:
    """Arguments of `node_wrapper.py train` for xtuner/tools/train.py."""
    args = wrapper_args("train", config, wrapper=wrapper)
    if distributed:
        args += ["--launcher", "pytorch"]
    if resume is not None:
        args += ["--resume", str(resume)]
    if deepspeed:
        args += ["--deepspeed", deepspeed]
    return args


def train_command(
    python: Path | str,
    config: Path,
    nproc: int,
    *,
    master_port: int,
    resume: Path | None = None,
    deepspeed: str | None = None,
    master_addr: str = "127.0.0.1",
    nnodes: int = 1,
    node_rank: int = 0,
    distributed: bool = False,
) -> Command:
    """One node's training command: the wrapper directly for one rank (unless `distributed`: mmengine wraps the
    model in its DDP wrapper only then), torch.distributed.run for several."""
    if nproc == 1 and nnodes == 1 and not distributed:
        return Command(
            [str(python), *train_args(config, distributed=False, resume=resume, deepspeed=deepspeed)], node_env()
        )
    argv = [
        str(python),
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        *train_args(config, distributed=True, resume=resume, deepspeed=deepspeed),
    ]
    return Command(argv, node_env())


def tool_command(python: Path | str, mode: str, *args: str | Path, wrapper: str | Path = WRAPPER) -> Command:
    """A single-process wrapper step: prepare, pth_to_hf, merge, probe."""
    return Command([str(python), *wrapper_args(mode, *map(str, args), wrapper=wrapper)], node_env())


#: runs one tool command somewhere (this machine, or a node): (command, log file, log, step name) -> exit code
Runner = Callable[[Command, Path, Callable[[str], None], str], int]


def local_runner(timeout_s: float | None = None) -> Runner:
    """Tool commands on this machine, streamed (run_streaming)."""

    def run(cmd: Command, log_file: Path, log: Callable[[str], None], step: str) -> int:
        return run_streaming(cmd, log_file, log, step=step, timeout_s=timeout_s)

    return run


def run_streaming(
    cmd: Command,
    log_file: Path,
    log: Callable[[str], None] = print,
    step: str = "xtuner",
    timeout_s: float | None = None,
    cwd: Path | None = None,
    ok_codes: Sequence[int] = (0,),
    started: Callable[[subprocess.Popen], None] | None = None,
) -> int:
    """Run `cmd` in its own process group, stream its lines to `log` and `log_file`; return the exit code.

    On timeout the whole group is killed and XTunerLaunchError is raised. Non-zero codes are returned, not
    raised, so the caller can map them (e.g. exit 3 = empty dataset). `started(proc)` is called once the
    process runs (a watchdog that may end it)."""
    from nightloom.provision.local import kill_group

    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **cmd.env}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with open(log_file, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd.argv)}\n")
        f.flush()
        proc = subprocess.Popen(
            cmd.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                f.flush()
                log(f"[{step}] {line.rstrip()}")

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        if started is not None:
            started(proc)
        try:
            code = proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            reader.join(timeout=10)
            raise XTunerLaunchError(f"{step}: timed out after {timeout_s} s; full log: {log_file}") from None
        except BaseException:
            kill_group(proc)
            raise
        kill_group(proc)  # the leader exited: reap anything it left in its group
        reader.join(timeout=30)
        f.write(f"[exit {code}]\n")
    return code


def tail(log_file: Path, n: int = 40) -> str:
    try:
        return "\n".join(log_file.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def check(code: int, step: str, log_file: Path) -> None:
    if code != 0:
        err = XTunerLaunchError(f"{step} failed with exit code {code}; full log: {log_file}\n{tail(log_file)}")
        err.code = code
        raise err
