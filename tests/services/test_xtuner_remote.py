"""XTuner on rented nodes (2 nodes x 1 rank, gloo). Over Slurm n1+n2: LoRA from an s3:// base model (fetched
once into the nodes' model cache, a per-test folder forwarded through srun) where n2 turns unhealthy mid-run and
the run resumes on the node left (a new allocation of n1, re-rendered for 1 rank, on the same cached model),
ending in a merged model equal to a PEFT merge. Over the two real sshd nodes: full fine-tuning from an s3:// base
model (fetched once into the nodes' cache), where node 2 turns unhealthy mid-run and a spare host takes its place
(the losses of the redone steps equal the first attempt's), ending in a Hugging Face model transformers loads,
then a LoRA run on the same nodes with 2 ranks each, cancelled once its 4 ranks are up. Cancellation mid-run
over SSH and over Slurm leaves no process and no Slurm job (each reuses the cached model). The XTuner env is
ensured on every node (reused warm through the shared env cache CI fills once); conversion and merge run on
node 0.

CI time: the SSH run carries full fine-tuning and recovery, the Slurm run LoRA to its merge; each cancellation
rides on its provider's nodes as a further run (env warm, processed data copied) and fires as soon as the
ranks are up. Fetching the tiny base model from SeaweedFS adds about 2 s per provider.
The nodes are this machine, so "remote" processes are found in /proc by the run folder in their command line.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from nightloom.finetune.attempts import UPSTREAM_ABORT
from nightloom.finetune.env import EnvError
from nightloom.finetune.remote import ensure_node_envs
from nightloom.finetune.run import run_xtuner
from nightloom.metrics import read_metrics
from nightloom.spec import RunSpec
from tests.support.ssh import ours_running
from tests.support.xtuner_data import alpaca_rows, make_spec, merged_vs_peft, write_shards

pytestmark = [pytest.mark.services, pytest.mark.timeout(600)]


def QUIET(s):
    return None


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"), alpaca_rows(48))


def remote_spec(tmp: Path, base_model: Path, shards: Path, cluster: dict, global_batch: int = 2, **train) -> RunSpec:
    """The local LoRA test's spec (4 steps, global batch 2) on a 2-node cluster of 1 rank each (`cluster` may
    set gpus_per_node)."""
    spec = make_spec(tmp, base_model, shards, method="lora", global_batch=global_batch, **train)
    data = spec.model_dump(mode="json", by_alias=True)
    data["cluster"] = {
        "nodes": 2,
        "gpus_per_node": 1,
        "gpu_type": "cpu",
        "name": f"xt-{tmp.name}",
        "master_port": 21000 + os.getpid() % 4000,
        **cluster,
    }
    return RunSpec.model_validate(data)


def ssh_cluster(sshenv, workdir: Path) -> dict:
    hosts = [
        {"host": h, "port": p, "user": sshenv["user"], "gpus": 1, "python": sys.executable, "workdir": str(workdir)}
        for h, p in sshenv["hosts"][:2]
    ]
    return {
        "provider": "ssh",
        "ssh": {
            "hosts": hosts,
            "key_env": "NIGHTLOOM_SSH_KEY_FILE",
            "known_hosts": os.environ["NIGHTLOOM_KNOWN_HOSTS"],
        },
    }


def check_lora_result(r, run_dir: Path, xtuner_env, base_model: Path, nodes: list[str], steps: int = 4) -> None:
    """Trained `steps` steps, metrics in the run folder, merged model == base ⊕ adapter (PEFT)."""
    assert r.steps_done == steps and r.stopped == "completed" and r.profile == "cpu"
    logged = read_metrics(r.metrics_path)
    assert [m.step for m in logged] == list(range(1, steps + 1)) and all(math.isfinite(m.loss) for m in logged)
    assert Path(r.metrics_path).parent == run_dir and Path(r.model_dir).parent == run_dir
    assert sorted(r.node_ready_s) == sorted(nodes) and all(s > 0 for s in r.node_ready_s.values())
    log = (run_dir / "xtuner" / "logs" / "train.log").read_text()
    assert all(f"[{n}] nightloom: CUDA absent" in log for n in nodes)  # a rank on each node
    convert_log = (run_dir / "xtuner" / "logs" / "convert.log").read_text()
    assert f"$ [{nodes[0]}]" in convert_log  # conversion and merge ran on node 0
    d = merged_vs_peft(xtuner_env, base_model, r.adapter_dir, r.model_dir)
    assert d["vs_peft16"] < 1e-6, d  # the merged model is exactly base ⊕ adapter
    assert d["vs_base"] > 1e-3, d  # LoRA changed the model


def test_xtuner_lora_over_slurm_recovers_on_the_node_left_then_cancel_leaves_nothing(
    slurm, xtuner_env, base_model, shards, s3_endpoint, tmp_path, monkeypatch
):
    """LoRA over n1+n2 from `model.weights: s3://...` (the tiny model uploaded to SeaweedFS), 16 steps, a
    checkpoint every 4. Each node fetches the model through an srun step into its model cache
    ($NIGHTLOOM_MODEL_CACHE, a folder of this test's, forwarded as the product forwards it; n1 and n2 share it
    here): one content-keyed folder, stamped, downloaded once (the other node finds it under the lock), and
    every launch's config names it. Once step 5 is logged, n2 turns unhealthy (its node environment, on n2 alone
    by $SLURMD_NODENAME, finds a fake torch) and its torchrun is killed: preflight names n2, the allocation is
    released and a new one excluding n2 gets n1 alone (min_nodes 1), the config is re-rendered for 1 rank
    (global batch 2 = 1 rank x 2 micro-batches of 1, the first plan's) on the same cached folder (nothing fetched
    again) and XTuner resumes from the last checkpoint there, its redone steps' losses equal to the first
    attempt's. The result, merged on node 0, equals a PEFT merge of the local copy. Then a longer run
    on that allocation (finding the model cached) is cancelled once its rank is up, as the flow's cancel hook
    does: no Slurm job and no process is left."""
    from nightloom.finetune.logs import launch_dirs, parse_launch
    from nightloom.model_cache import STAMP
    from nightloom.provision.slurm import SlurmProvider, queued
    from tests.support.ssh import plant_fake_torch

    endpoint, bucket = s3_endpoint
    uri = upload_model(base_model, endpoint, f"s3://{bucket}/models/tiny-slurm")
    cache = tmp_path / "model-cache"
    monkeypatch.setenv("NIGHTLOOM_MODEL_CACHE", str(cache))  # forwarded to each node's fetch (srun's env K=V)
    slot = tmp_path / "sick-slot"
    slot.mkdir()
    wrapper = tmp_path / "python-nodes"  # the nodes' interpreter: a node environment of this test's own
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    partition = os.environ.get("NIGHTLOOM_SLURM_PARTITION", "debug")
    cluster = {"provider": "slurm", "slurm": {"partition": partition, "python": str(wrapper)}, "min_nodes": 1}
    spec = remote_spec(tmp_path, base_model, shards, cluster, steps=16, checkpoint_every=4)
    data = spec.model_dump(mode="json", by_alias=True)  # the base model through model.weights (s3://)
    data["model"]["weights"], data["train"]["xtuner"]["base_model"] = uri, ""
    data["storage"]["s3_endpoint_url"] = endpoint
    data["recovery"]["max_attempts"] = 1
    spec = RunSpec.model_validate(data)
    run_dir, cancel_dir = tmp_path / "runs" / "slurm-lora", tmp_path / "runs" / "slurm-cancel"
    work_dir = run_dir / "xtuner" / "work_dir"
    p = SlurmProvider(spec)
    c = p.acquire()
    node_env = Path(c.nodes[0].python).parent.parent  # n1 and n2 share this host and this environment

    def sicken():
        plant_fake_torch(slot)  # preflight runs in the node environment: on n2 alone it now finds a fake torch
        (site,) = node_env.glob("lib/python3*/site-packages")
        (site / "zz_test_sick_n2.pth").write_text(
            f"import os, sys; os.environ.get('SLURMD_NODENAME') == 'n2' and sys.path.insert(0, {str(slot)!r})\n"
        )
        # n2's torchrun agent and its rank (torchrun starts each worker in a session of its own)
        agents = _pids("--node-rank=1", str(run_dir), program="-m torch.distributed.run")
        for pid in agents + [p for p in _pids(str(run_dir)) if _ppid(p) in agents]:
            os.kill(pid, signal.SIGKILL)

    chaos = _when(_logged(work_dir, 5), sicken)
    t0, r, run_log, cancel_log = time.monotonic(), None, [], []
    try:
        assert [n.name for n in c.nodes] == ["n1", "n2"]
        r = run_xtuner(spec, shards, run_dir, cluster=c, provider=p, log=run_log.append)
        wall = time.monotonic() - t0
        chaos.join(timeout=5)
        longer = spec.model_copy(  # cancelled, not failed: no recovery (the flow's cancel hook ends the flow too)
            update={
                "train": spec.train.model_copy(update={"steps": 400}),
                "recovery": spec.recovery.model_copy(update={"max_attempts": 0}),
            }
        )
        shutil.copytree(run_dir / "xtuner" / "processed", cancel_dir / "xtuner" / "processed")
        cancel = _when(_ranks_up(cancel_dir, 1), lambda: SlurmProvider(spec).release(r.cluster))
        with pytest.raises(Exception, match="train failed|not running|did not finish"):
            run_xtuner(longer, shards, cancel_dir, cluster=r.cluster, provider=p, log=cancel_log.append, convert=False)
        cancel.join(timeout=5)
    finally:
        p.release(c)
        if r is not None and r.cluster is not None:
            p.release(r.cluster)
        shutil.rmtree(node_env, ignore_errors=True)  # this test's own node environment (keyed by the wrapper)
    (ev,) = r.interruptions
    fetches = [x for x in run_log + cancel_log if x.startswith("base model on node")]
    print(f"\nxtuner over slurm: wall {wall:.1f} s, recovery_s {ev.recovery_s}, stages {r.stage_s}, {fetches}")
    assert queued(c.handle["job_id"]) is None and queued(r.cluster.handle["job_id"]) is None, "an allocation is left"
    deadline = time.monotonic() + 20
    while _pids(str(cancel_dir)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _pids(str(cancel_dir)), "a process of the cancelled run outlived the cancellation"
    assert not ours_running(str(run_dir)), "a process of the run outlived release"

    # the base model: one content-keyed folder in the test's cache, stamped for this prefix, fetched by one node
    # while the other waited on the lock and found it; no fetch at recovery (n1 kept), the cancelled run reused it
    (stamp,) = cache.glob(f"*/{STAMP}")
    cached = stamp.parent
    assert json.loads(stamp.read_text())["uri"] == uri and cached.name == json.loads(stamp.read_text())["key"]
    assert sorted(f.name for f in cached.iterdir() if f.name != STAMP) == sorted(
        f.name for f in base_model.iterdir() if f.is_file()
    )
    assert sorted(x.split(":")[1].split()[0] for x in fetches) == ["cached", "cached", "fetched"], fetches
    assert fetches[-1].startswith("base model on node n1: cached"), fetches  # the cancelled run, on n1
    assert "base_model_s" in r.stage_s
    # both launches (2 ranks, then 1 rank re-rendered after recovery) trained from that folder
    for d in launch_dirs(work_dir):
        (dumped,) = d.glob("vis_data/config.py")  # mmengine's copy of the config that launch ran
        assert str(cached) in dumped.read_text() and str(base_model) not in dumped.read_text(), d
    assert f"pretrained_model_name_or_path = {str(cached)!r}" in Path(r.config_path).read_text()

    # recovery on the node left: n2 excluded, a new allocation of n1 alone, 1 rank, resumed from iter_4
    assert ev.kind == "node" and "n2" in ev.detail and "torch: 0.0.1-fake" in ev.detail, ev.detail
    assert ev.world_before == 2 and ev.world_after == 1, ev.detail
    # the kill lands once step 5 is logged (later on a loaded box): resumed from the last checkpoint before it
    resumed = int(re.search(r"resumed from iter_(\d+)\.pth on n1$", ev.detail).group(1))
    assert [n.name for n in r.cluster.nodes] == ["n1"] and "n2" in r.cluster.excluded
    assert r.cluster.handle["job_id"] != c.handle["job_id"]
    first, last = parse_launch(launch_dirs(work_dir)[0]), parse_launch(launch_dirs(work_dir)[-1])
    assert len(launch_dirs(work_dir)) == 2 and int(last[0]["step"]) == resumed + 1 and int(last[-1]["step"]) == 16
    # re-rendered: 1 rank takes both sequences of a step, in two micro-batches of one (the first plan's forward)
    config = Path(r.config_path).read_text().replace(" ", "")
    assert "batch_size=2" in config and "micro_batches=2" in config
    # so each step's gradient is the 2-rank step's, and both layouts log the whole step's loss: the redone
    # steps' losses equal the first attempt's at the local resume test's tolerance
    before = {int(x["step"]): float(x["loss"]) for x in first}
    redone = [(int(x["step"]), float(x["loss"])) for x in last if int(x["step"]) in before]
    assert redone, (first, last)
    print(f"redone steps (step, loss after recovery, first attempt's): {[(s, x, before[s]) for s, x in redone]}")
    for step, loss in redone:
        assert loss == pytest.approx(before[step], rel=1e-5), (step, before, last)
    check_lora_result(r, run_dir, xtuner_env, base_model, ["n1", "n2"], steps=16)


def _pids(*needles: str, program: str = "") -> list[int]:
    """Live processes whose command line holds every needle (and starts `argv[0] program...` when given)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                cmd = (p / "cmdline").read_bytes()
                if (p / "stat").read_text().split()[2] == "Z":
                    continue
            except OSError:
                continue
            argv = cmd.decode(errors="replace").split("\0")
            if all(n.encode() in cmd for n in needles) and " ".join(argv[1:]).startswith(program):
                out.append(int(p.name))
    return out


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _when(ready, action, timeout_s: float = 400) -> threading.Thread:
    """Run `action()` in a thread once `ready()` is true (polled every 0.1 s)."""

    def go():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                action()
                return
            time.sleep(0.1)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _ranks_up(run_dir: Path, n: int = 2, world: int | None = None):
    """True once train.log shows `n` ranks started (node_wrapper's first line, per rank) and, given `world`,
    mmengine's environment report counts that many."""
    log = run_dir / "xtuner" / "logs" / "train.log"

    def ready() -> bool:
        text = log.read_text(errors="replace") if log.is_file() else ""
        return text.count("nightloom: CUDA absent") >= n and (world is None or f"GPU number: {world}" in text)

    return ready


def _logged(work_dir: Path, step: int):
    """True once the first launch logged `step` and a checkpoint is complete (`last_checkpoint` names it)."""
    from nightloom.finetune.logs import launch_dirs, parse_launch

    def ready():
        dirs = launch_dirs(work_dir)
        if not dirs or not (work_dir / "last_checkpoint").is_file():
            return False
        try:
            return any(int(x["step"]) >= step for x in parse_launch(dirs[0]))
        except Exception:  # noqa: BLE001 - the scalars file is being written
            return False

    return ready


def upload_model(folder: Path, endpoint: str, uri: str, skip: tuple[str, ...] = ()) -> str:
    """Every file of a local model folder under an s3:// prefix (the way users upload: boto3)."""
    import boto3

    from nightloom.storage import S3Location

    loc = S3Location.parse(uri)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name not in skip:
            client.upload_file(str(f), loc.bucket, f"{loc.key}/{f.name}")
    return uri


def test_xtuner_full_over_ssh_from_s3_recovers_onto_a_spare(
    sshenv, xtuner_env, base_model, shards, s3_endpoint, tmp_path, monkeypatch
):
    """Full fine-tuning over the two sshd nodes of a base model named by `model.weights: s3://...`: each node
    fetches it into its cache (the nodes share one here: one download, hash-checked, stamp last). After the
    checkpoint at step 6 and step 7 logged, node 2 turns unhealthy (a fake torch, its torchrun killed):
    preflight excludes it, the spare host joins (world size stays 2, the config is not re-rendered), XTuner
    resumes from step 6 and the redone steps' losses equal the first attempt's at the local resume test's
    tolerance. The result is a Hugging Face model (converted on node 0) that transformers loads. Then a
    LoRA run on both sshd nodes with 2 ranks each reuses the cached model and is cancelled once its 4 ranks are
    up: nothing of it is left."""
    from nightloom.finetune.base_model import BaseSource, check_source
    from nightloom.finetune.config import TOKENIZER_FILES, XTunerConfigError
    from nightloom.finetune.logs import launch_dirs, parse_launch
    from nightloom.model_cache import STAMP
    from nightloom.provision.ssh import SSHProvider
    from nightloom.storage import S3Config
    from tests.support.ssh import plant_fake_torch
    from tests.support.xtuner_data import run_in_env

    endpoint, bucket = s3_endpoint
    uri = upload_model(base_model, endpoint, f"s3://{bucket}/models/tiny")
    no_tok = upload_model(base_model, endpoint, f"s3://{bucket}/models/no-tok", skip=TOKENIZER_FILES)
    with pytest.raises(XTunerConfigError, match=r"model\.weights: s3://.*/no-tok: missing a tokenizer"):
        check_source(BaseSource(no_tok, "model.weights"), S3Config(endpoint_url=endpoint))  # before renting
    # the nodes' own credential chain: a credentials file (its path travels to the nodes, never the keys)
    creds = tmp_path / "aws-credentials"
    creds.write_text(
        f"[default]\naws_access_key_id = {os.environ['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {os.environ['AWS_SECRET_ACCESS_KEY']}\n"
    )
    creds.chmod(0o600)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("NIGHTLOOM_MODEL_CACHE", str(tmp_path / "model-cache"))

    slot = tmp_path / "sick-slot"
    slot.mkdir()
    sick = tmp_path / "python-node2"
    sick.write_text(f'#!/bin/sh\nPYTHONPATH={slot} exec {sys.executable} "$@"\n')
    sick.chmod(0o755)
    cluster = ssh_cluster(sshenv, tmp_path / "nodes")
    cluster["ssh"]["hosts"][1]["python"] = str(sick)
    h, port = sshenv["hosts"][0]
    cluster["ssh"]["hosts"].append(
        {"host": h, "port": port, "user": sshenv["user"], "gpus": 1, "python": sys.executable, "spare": True}
        | {"workdir": str(tmp_path / "spare")}
    )
    spec = remote_spec(tmp_path, base_model, shards, cluster, steps=12, checkpoint_every=6)
    data = spec.model_dump(mode="json", by_alias=True)
    data["model"]["weights"] = uri
    data["train"]["xtuner"].update(method="full", base_model="")
    data["storage"]["s3_endpoint_url"] = endpoint
    data["recovery"]["max_attempts"] = 1
    spec = RunSpec.model_validate(data)
    run_dir = tmp_path / "runs" / "ssh-full"
    work_dir = run_dir / "xtuner" / "work_dir"
    p = SSHProvider(spec)
    c = p.acquire()
    bad, spare = c.nodes[1].name, f"{h}:{port}#2"
    # train.xtuner.python is verified on every node, never built; a bad one names each node
    with pytest.raises(EnvError, match=r"node 127\.0\.0\.1:\d+: FileNotFoundError.*train\.xtuner\.python="):
        ensure_node_envs(p, c, "cpu", python="/nonexistent/python")

    def sicken():
        plant_fake_torch(slot)
        # node 2's torchrun agent and its rank (torchrun starts each worker in a session of its own)
        agents = _pids("--node-rank=1", str(run_dir), program="-m torch.distributed.run")
        for pid in agents + [p for p in _pids(str(run_dir)) if _ppid(p) in agents]:
            os.kill(pid, signal.SIGKILL)

    chaos = _when(_logged(work_dir, 7), sicken)
    t0, r = time.monotonic(), None
    cancel_dir, cancel_log = tmp_path / "runs" / "ssh-cancel", []
    try:
        r = run_xtuner(spec, shards, run_dir, cluster=c, provider=p, log=QUIET)
        wall = time.monotonic() - t0
        chaos.join(timeout=5)
        # Phase 2, cancellation over SSH of a LoRA run on both sshd nodes with 2 ranks each (4 ranks, global batch
        # 4; code, env and model warm, the processed data copied): once torchrun has started both ranks on each
        # node and mmengine counts 4, it is torn down as the flow's cancel hook does (a fresh provider releases
        # the recorded cluster). LoRA to the end and its merge are the Slurm test's.
        duo = ssh_cluster(sshenv, tmp_path / "nodes")
        for host in duo["ssh"]["hosts"]:
            host["gpus"] = 2
        lora_spec = remote_spec(tmp_path, base_model, shards, {**duo, "gpus_per_node": 2}, global_batch=4, steps=400)
        lora_data = lora_spec.model_dump(mode="json", by_alias=True)
        lora_data["model"]["weights"], lora_data["train"]["xtuner"]["base_model"] = uri, ""
        lora_data["storage"]["s3_endpoint_url"] = endpoint
        lora_data["recovery"]["max_attempts"] = 0
        lora_spec = RunSpec.model_validate(lora_data)
        shutil.copytree(run_dir / "xtuner" / "processed", cancel_dir / "xtuner" / "processed")
        p2 = SSHProvider(lora_spec)
        c2 = p2.acquire()
        try:
            cancel = _when(_ranks_up(cancel_dir, 4, world=4), lambda: SSHProvider(lora_spec).release(c2))
            with pytest.raises(Exception, match="train failed|not running|did not finish"):
                run_xtuner(lora_spec, shards, cancel_dir, cluster=c2, provider=p2, log=cancel_log.append, convert=False)
        finally:
            p2.release(c2)
        cancel.join(timeout=5)
    finally:
        p.release(c.union(r.cluster) if r is not None and r.cluster else c)
    deadline = time.monotonic() + 20
    while _pids(str(cancel_dir)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _pids(str(cancel_dir)), "a process of the cancelled run outlived the cancellation"
    assert sum("base model on node" in x and " cached " in x for x in cancel_log) == 2, cancel_log  # reused
    # besides the node's, the only interruption may be the known gloo abort while a checkpoint is saved
    # (nightloom.finetune.attempts.UPSTREAM_ABORT), relaunched from that checkpoint on its own budget
    (ev,) = [e for e in r.interruptions if e.kind == "node"]
    aborts = [e for e in r.interruptions if e.kind != "node"]
    train_log = (run_dir / "xtuner" / "logs" / "train.log").read_text()
    assert all(a.kind == "transient" for a in aborts) and (not aborts or UPSTREAM_ABORT in train_log), aborts
    print(f"\nxtuner ssh full + recovery: wall {wall:.1f} s, recovery_s {ev.recovery_s}, stages {r.stage_s}")

    # the base model: fetched once into the shared cache, stamped, and that folder is what XTuner trained
    (cached,) = (tmp_path / "model-cache").glob(f"*/{STAMP}")
    assert f"pretrained_model_name_or_path = {str(cached.parent)!r}" in Path(r.config_path).read_text()
    assert "base_model_s" in r.stage_s
    # recovery: node 2 excluded, the spare joined, same world size, resumed from the step-6 checkpoint
    assert ev.kind == "node" and bad in ev.detail and "torch: 0.0.1-fake" in ev.detail, ev.detail
    assert ev.world_before == 2 and ev.world_after == 2 and spare in ev.detail, ev.detail
    assert [n.name for n in r.cluster.nodes] == [c.nodes[0].name, spare] and bad in r.cluster.excluded
    assert r.steps_done == 12 and r.stopped == "completed" and r.profile == "cpu"
    dirs = launch_dirs(work_dir)
    assert len(dirs) == 2 + len(aborts), (dirs, r.interruptions)
    logged: dict[int, list[float]] = {}
    for d in dirs:
        for x in parse_launch(d):
            logged.setdefault(int(x["step"]), []).append(float(x["loss"]))
    assert sorted(logged) == list(range(1, 13)), logged
    redone = {step: losses for step, losses in logged.items() if len(losses) > 1}
    assert redone and min(redone) == 7, logged  # the recovery resumed from the step-6 checkpoint
    for step, losses in redone.items():  # same world size, same data order, same state: the same losses
        assert all(x == pytest.approx(losses[0], rel=1e-5) for x in losses), (step, logged)
    steps = read_metrics(r.metrics_path)
    assert [m.step for m in steps] == list(range(1, 13)) and all(math.isfinite(m.loss) for m in steps)
    assert steps[-1].loss < steps[0].loss  # full fine-tuning learns
    # the result: a Hugging Face model in the run folder, converted on node 0, that transformers loads
    assert r.adapter_dir is None and Path(r.model_dir) == run_dir / "export"  # as a native run
    assert f"$ [{c.nodes[0].name}]" in (run_dir / "xtuner" / "logs" / "convert.log").read_text()
    out = run_in_env(
        xtuner_env,
        f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({r.model_dir!r})
ids = tok("what is the sum of a list", return_tensors="pt").input_ids
m = AutoModelForCausalLM.from_pretrained({r.model_dir!r}, torch_dtype=torch.float32).eval()
b = AutoModelForCausalLM.from_pretrained({str(base_model)!r}, torch_dtype=torch.float32).eval()
with torch.no_grad():
    lm, lb = m(ids).logits, b(ids).logits
print(json.dumps({{"finite": bool(torch.isfinite(lm).all()), "vs_base": (lm - lb).abs().max().item(),
                  "params": sum(p.numel() for p in m.parameters()), "base_params": sum(p.numel() for p in b.parameters())}}))
""",
    )
    d = json.loads(out.strip().splitlines()[-1])
    assert d["finite"] and d["params"] == d["base_params"] and d["vs_base"] > 1e-3, d
    assert not _pids(str(run_dir)), "a process of the run outlived release"
    # the cancelled run, 2 nodes x 2 ranks: torchrun started 2 ranks on each node, mmengine counted 4, and each
    # rank was to take 1 sequence of the 4 per step
    assert len(c2.nodes) == 2 and c2.world_size == 4
    cancel_train_log = (cancel_dir / "xtuner" / "logs" / "train.log").read_text()
    assert all(cancel_train_log.count(f"[{n.name}] nightloom: CUDA absent") == 2 for n in c2.nodes), cancel_train_log
    assert "GPU number: 4" in cancel_train_log  # mmengine's world size
    assert "batch_size = 1 " in (cancel_dir / "xtuner" / "config.py").read_text()
