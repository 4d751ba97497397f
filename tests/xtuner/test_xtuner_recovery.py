"""XTuner's recovery on the local provider, in its env on CPU: the same budget as native training. A rank is
killed mid-run; the relaunch has the recovery time left (recovery.max_minutes) to log its first step, and once
that time is spent no further relaunch is made though recovery.max_attempts remain."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from nightloom.finetune.launcher import XTunerLaunchError
from nightloom.finetune.logs import launch_dirs, parse_launch, step_of
from nightloom.finetune.run import run_xtuner
from nightloom.provision.local import LocalProvider
from nightloom.spec import RunSpec
from tests.support.xtuner_data import alpaca_rows, make_spec, write_shards


def rank_pids(run_dir: Path) -> list[int]:
    """XTuner's training ranks of this run (node_wrapper.py train <run_dir>/xtuner/config.py), not torchrun."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "node_wrapper.py" in cmd and str(run_dir) in cmd and "torch.distributed.run" not in cmd:
            out.append(int(p.name))
    return out


def kill_ranks_once_logged(run_dir: Path, step: int, before=None) -> threading.Thread:
    """SIGKILL the ranks once the first launch logged `step` and a checkpoint is complete (`before()` first)."""
    work_dir = run_dir / "xtuner" / "work_dir"

    def ready() -> bool:
        dirs = launch_dirs(work_dir)
        if not dirs or not (work_dir / "last_checkpoint").is_file():
            return False
        try:
            return any(int(x["step"]) >= step for x in parse_launch(dirs[0]))
        except Exception:  # noqa: BLE001 - the scalars file is being written
            return False

    def go() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ready():
            time.sleep(0.05)
        if before is not None:
            before()
        for pid in rank_pids(run_dir):
            os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_xtuner_max_minutes_spent_stops_relaunching(xtuner_env, base_model, tmp_path):
    """LoRA on a local cluster (1 node x 1 rank), recovery.max_attempts 3 and max_minutes 0.01 (0.6 s). The
    rank is killed after step 3 (checkpoint iter_2 saved): preflight passes, so it is a transient failure and
    relaunched (nothing spent yet) from iter_2, with the time left, at least a second, to log its first step.
    XTuner cannot start that fast: the relaunch is ended as a stall, the time to recover is past max_minutes,
    and the run stops there with the reason, though 2 attempts remain."""
    shards = write_shards(tmp_path / "shards", alpaca_rows(48))
    spec = make_spec(tmp_path, base_model, shards, steps=40, checkpoint_every=2)
    data = spec.model_dump(mode="json", by_alias=True)
    data["cluster"]["name"] = f"xt-{tmp_path.name}"
    data["recovery"] = {"max_attempts": 3, "max_minutes": 0.01}
    spec = RunSpec.model_validate(data)
    run_dir = tmp_path / "run"
    provider = LocalProvider(spec)
    cluster = provider.acquire()
    said: list[str] = []
    killer = kill_ranks_once_logged(run_dir, 3)
    try:
        with pytest.raises(XTunerLaunchError, match=r"recovery gave up after 2 failure\(s\): out of time") as e:
            run_xtuner(spec, shards, run_dir, cluster=cluster, provider=provider, env=xtuner_env, log=said.append)
    finally:
        provider.release(cluster)
    killer.join(timeout=5)
    first, second = e.value.events
    assert first.kind == "transient" and "killed" in first.detail and "preflight passed" in first.detail, first.detail
    assert "resumed from iter_" in first.detail and first.world_after == 1
    assert first.recovery_s is None and first.detail.endswith("; not recovered")  # no step within the time left
    assert "stall: no training step logged within 1 s of the relaunch" in second.detail, second.detail
    assert "gave up: out of time" in second.detail and "recovery.max_minutes=0.01" in second.detail
    assert sum(x.startswith("xtuner: recovery ") for x in said) == 1  # one relaunch, of 3 allowed
    # the first attempt's steps as streamed: what tells a relaunch's first step
    train_log = (run_dir / "xtuner" / "logs" / "train.log").read_text()
    assert [step_of(x) for x in train_log.splitlines() if step_of(x)][:3] == [1, 2, 3]
    assert not rank_pids(run_dir), "a rank outlived the run"


def test_xtuner_relaunches_onto_a_spare_node_and_times_the_recovery(xtuner_env, base_model, tmp_path):
    """LoRA on 2 local nodes x 1 rank with recovery.spare_nodes 1: after step 3 node local-1 turns unhealthy
    and the ranks are killed. Preflight names local-1, the provider's spare local-2 takes its place (the world
    size stays 2, the config is not re-rendered), XTuner resumes from its checkpoint and finishes; the time to
    recover runs to the relaunch's first logged step, as for native training."""
    from nightloom.provision.local import unhealthy_dir
    from tests.support.recovery import mark_unhealthy

    shards = write_shards(tmp_path / "shards", alpaca_rows(48))
    spec = make_spec(tmp_path, base_model, shards, steps=12, checkpoint_every=2)
    data = spec.model_dump(mode="json", by_alias=True)
    data["cluster"].update(name=f"xt-{tmp_path.name}", nodes=2)
    data["recovery"] = {"max_attempts": 1, "max_minutes": 10, "spare_nodes": 1}
    spec = RunSpec.model_validate(data)
    run_dir = tmp_path / "run"
    provider = LocalProvider(spec)
    cluster = provider.acquire()
    killer = kill_ranks_once_logged(run_dir, 3, before=lambda: mark_unhealthy(unhealthy_dir(spec), "local-1"))
    try:
        r = run_xtuner(spec, shards, run_dir, cluster=cluster, provider=provider, env=xtuner_env, log=lambda s: None)
    finally:
        provider.release(cluster)
    killer.join(timeout=5)
    (ev,) = [e for e in r.interruptions if e.kind == "node"]
    assert "local-1" in ev.detail and ev.world_before == ev.world_after == 2 and "on local-0, local-2" in ev.detail
    assert ev.recovery_s is not None and ev.recovery_s > 0 and ev.lost_s == ev.recovery_s
    assert [n.name for n in r.cluster.nodes] == ["local-0", "local-2"] and "local-1" in r.cluster.excluded
    assert r.steps_done == 12 and r.stopped == "completed" and len(launch_dirs(run_dir / "xtuner" / "work_dir")) >= 2
