"""Fine-tune with XTuner from a RunSpec: plan → prepare data → train (with recovery) → metrics → convert → publish.

`run_xtuner` is the one entry the pipeline calls when `train.backend == "xtuner"`. Its steps are modules of
their own: xtuner_plan.py checks every input and renders the config (anything wrong fails there, before any rank
starts), attempts.py launches XTuner's train tool under nightloom.recovery's rule, convert.py turns the
checkpoint into a Hugging Face model and publishes it, remote.py readies rented nodes. This module prepares
the data and writes what the run leaves: metrics.jsonl and result.json.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, Field

from nightloom.finetune import config as xcfg
from nightloom.finetune.attempts import XTunerRecovery, train_with_recovery
from nightloom.finetune.convert import convert_checkpoint
from nightloom.finetune.env import XTunerEnv
from nightloom.finetune.launcher import Runner, XTunerLaunchError, check, local_runner, tail, tool_command
from nightloom.finetune.logs import RunShape, write_metrics
from nightloom.finetune.node_wrapper import EXIT_EMPTY_DATASET
from nightloom.finetune.remote import RunNodes, is_remote, node_peak, node_runner
from nightloom.finetune.track_feed import fed_trackers
from nightloom.finetune.xtuner_plan import XTunerPlan, plan_for_world, plan_xtuner
from nightloom.metrics import read_metrics
from nightloom.provision.base import Cluster
from nightloom.runfiles import RunFiles
from nightloom.spec import RunSpec
from nightloom.train.job import TrainResult
from nightloom.util import atomic_write_text

Log = Callable[[str], None]


class XTunerInterruption(BaseModel):
    """One failure recovered from (or given up on): what preflight found, and the world before and after."""

    attempt: int
    kind: str
    detail: str
    at: datetime
    recovery_s: float | None = None  # failure detected -> the relaunch's first step (None: not recovered)
    lost_s: float | None = None  # time to recover (or until the next failure when it never recovered)
    world_before: int
    world_after: int | None = None

    @classmethod
    def of(cls, e) -> XTunerInterruption:
        """From a nightloom.recovery.Event: its fields of the same names."""
        return cls.model_validate({k: getattr(e, k) for k in cls.model_fields})


class XTunerResult(TrainResult):
    """TrainResult plus where XTuner put things (a TrainResult to the rest of the pipeline)."""

    metrics_path: str
    config_path: str
    # the Hugging Face model (merged when LoRA and merge_lora): `export/`, also the record's export_dir, as a
    # native run's; a LoRA adapter is TrainResult.adapter_dir, `export/adapter/` (convert.py; older runs: model/, adapter/)
    model_dir: str | None = None
    published: str | None = None
    processed_rows: int = 0
    processed_tokens: int = 0
    env_python: str = ""
    env_key: str = ""
    profile: str = ""
    stage_s: dict[str, float] = Field(default_factory=dict)
    interruptions: list[XTunerInterruption] = Field(default_factory=list)
    cluster: Cluster | None = None  # the nodes the run ended on (recovery may have excluded or replaced some)
    node_ready_s: dict[str, float] = Field(default_factory=dict)  # XTuner env time to ready per remote node
    node_env_cold: dict[str, bool] = Field(default_factory=dict)  # whether that node built its env (cold)


def prepare_data(
    plan: XTunerPlan, log: Log = print, timeout_s: float | None = 3600, runner: Runner | None = None
) -> dict:
    """Tokenize and pack the shards once (skipped when inputs are unchanged); error when nothing is left.
    `runner`: where the XTuner env runs it (default: this machine; node 0 for remote clusters)."""
    processed = Path(plan.processed_dir)
    key_file = processed / "nightloom_prepare_key"
    if key_file.is_file() and key_file.read_text(encoding="utf-8").strip() == plan.prepare_key:
        log(f"xtuner: processed dataset is up to date: {processed}")
        return xcfg.read_processed_stats(processed)
    log_file = Path(plan.log_dir) / "prepare.log"
    cmd = tool_command(plan.python, "prepare", plan.config_path, wrapper=plan.wrapper)
    code = (runner or local_runner(timeout_s))(cmd, log_file, log, "prepare")
    if code == EXIT_EMPTY_DATASET:
        raise xcfg.XTunerConfigError(
            f"processed dataset is empty: {len(plan.data_files)} shard(s) gave no trainable sample "
            f"(see {log_file}):\n{tail(log_file, 3)}"
        )
    check(code, "prepare", log_file)
    stats = xcfg.read_processed_stats(processed)
    key_file.write_text(plan.prepare_key + "\n", encoding="utf-8")
    return stats


def run_shape(plan: XTunerPlan) -> RunShape:
    """What a step of `plan` means in tokens and FLOPs (for tokens/s and MFU)."""
    return RunShape(plan.tokens_per_step, plan.flops_per_token, plan.world_size, plan.peak_flops)


def write_step_metrics(plan: XTunerPlan, attempt: int = 0) -> Path:
    """metrics.jsonl in the run dir from every launch's mmengine logs."""
    out = RunFiles(plan.run_dir).metrics
    write_metrics(Path(plan.work_dir), out, run_shape(plan), attempt)
    return out


def _plan_on_nodes(nodes: RunNodes, cluster, plan: XTunerPlan, peak_flops: float | None) -> XTunerPlan:
    """The plan with the nodes' paths; on GPU without a given peak, the catalog peak of the GPU node 0 reports."""
    plan = nodes.for_nodes(cluster, plan)
    if plan.profile == "gpu" and peak_flops is None:
        peak = node_peak(nodes.envs[cluster.nodes[0].name])
        plan = plan.model_copy(update={"peak_flops": peak.flops, "peak_source": peak.source})
    return plan


def _train(spec: RunSpec, manifest, plan: XTunerPlan, cluster, provider, nodes, env, base_path, resume, log, timeout_s):
    """Train under spec.recovery's rule (nightloom.finetune.attempts); the clusters recovery reacquired are
    released here if the run fails after them."""
    first = plan
    held: list[Cluster] = []
    rules = XTunerRecovery.from_spec(
        spec,
        on_a_cluster=cluster is not None,
        replan=lambda w: plan_for_world(spec, manifest, first, w, env=env, base_path=base_path, log=log),
        ready=nodes.ready if nodes is not None else None,
        on_cluster=held.append,
    )
    try:
        return train_with_recovery(
            plan, cluster=cluster, provider=provider, resume=resume, log=log, timeout_s=timeout_s, rules=rules
        )
    except BaseException:
        for c in held:
            if c.handle != cluster.handle:  # a new allocation (slurm): the caller only knows the first one
                provider.release(c)
        raise


def _convert(spec: RunSpec, plan: XTunerPlan, ckpt, run_dir: Path, publish_to, runner, log: Log) -> dict:
    """The checkpoint as a Hugging Face model, published to `publish_to` (default: under an s3 storage root)."""
    if publish_to is None and spec.storage.root.startswith("s3://"):
        publish_to = f"{spec.storage.root.rstrip('/')}/{spec.name}/{run_dir.name}/model"
    return convert_checkpoint(
        plan, ckpt, log=log, publish_to=publish_to, s3_endpoint_url=spec.storage.s3_endpoint_url, runner=runner
    )


def _result(plan: XTunerPlan, steps, ckpt, metrics_path, conv, stats, stage, trained, cluster, nodes, t0):
    """The run's XTunerResult (result.json): the last step, where things went, the stages' times, recoveries."""
    last = steps[-1]
    return XTunerResult(
        steps_done=last.step,
        total_steps=plan.total_steps,
        stopped="completed",
        final_loss=last.loss,
        tokens=sum(m.tokens for m in steps),
        wall_s=time.monotonic() - t0,
        last_checkpoint=str(ckpt),
        metrics_path=str(metrics_path),
        config_path=plan.config_path,
        model_dir=conv.get("model_dir"),
        export_dir=conv.get("model_dir"),  # the summary's export and adapter rows read these two
        adapter_dir=conv.get("adapter_dir"),
        published=conv.get("published"),
        processed_rows=stats["rows"],
        processed_tokens=stats["tokens"],
        env_python=plan.python,
        env_key=plan.env_key,
        profile=plan.profile,
        peak_flops=plan.peak_flops,
        peak_source=plan.peak_source,  # the MFU peak (validation needs it on CPU)
        stage_s={k: round(v, 2) for k, v in stage.items()},
        interruptions=[XTunerInterruption.of(e) for e in trained.events],
        cluster=cluster,
        node_ready_s={k: e.ready_s for k, e in (nodes.envs if nodes else {}).items()},
        node_env_cold={k: e.created for k, e in (nodes.envs if nodes else {}).items()},
    )


def run_xtuner(
    spec: RunSpec,
    manifest,
    run_dir: str | Path,
    cluster=None,
    log: Log = print,
    *,
    provider=None,
    env: XTunerEnv | None = None,
    resume: bool = True,
    convert: bool = True,
    publish_to: str | None = None,
    peak_flops: float | None = None,
    timeout_s: float | None = None,
) -> XTunerResult:
    """Fine-tune `spec` with XTuner on the shards of `manifest`; write metrics.jsonl, result.json and the model.

    `manifest`: a shard folder, a manifest.json path, or a ShardManifest (located by spec.sharding.output).
    `cluster`/`provider`: launch on the provider's nodes (their interpreters replaced by the XTuner env's),
    recovering within spec.recovery; without them, ranks run on this machine (world size = spec.world_size).
    `publish_to`: local folder or s3:// prefix for the final model; default: s3 storage roots get
    `<root>/<spec.name>/<run_dir name>/model`, local ones keep it in `<run_dir>/export` (adapter: `export/adapter`).
    """
    t0 = time.monotonic()
    stage: dict[str, float] = {}
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    world = cluster.world_size if cluster is not None else spec.world_size
    runner: Runner | None = None
    nodes = RunNodes(spec, provider, run_dir, log) if is_remote(cluster) else None
    if nodes is not None:  # the XTuner env on every node; XTuner's tools run on node 0
        env = nodes.ensure_envs(cluster)
        runner = node_runner(provider, cluster, cluster.nodes[0])
        stage["node_env_s"] = time.monotonic() - t0
        t = time.monotonic()
        if nodes.ensure_model(cluster) is not None:  # the base model in every node's cache, fetched there once
            stage["base_model_s"] = time.monotonic() - t
    base_path = nodes.base_path if nodes is not None else None
    plan = plan_xtuner(
        spec, manifest, run_dir, world_size=world, env=env, peak_flops=peak_flops, log=log, base_path=base_path
    )
    if nodes is not None:
        plan = _plan_on_nodes(nodes, cluster, plan, peak_flops)
    stage["plan_s"] = time.monotonic() - t0
    t = time.monotonic()
    stats = prepare_data(plan, log=log, runner=runner)
    stage["prepare_s"] = time.monotonic() - t

    t = time.monotonic()
    # track: every step to the trackers, as a native rank 0 sends it (live from XTuner's logs, then metrics.jsonl)
    with fed_trackers(spec.track, run_dir, run_dir.name, plan.work_dir, run_shape(plan), plan.total_steps) as feed:
        trained = _train(spec, manifest, plan, cluster, provider, nodes, env, base_path, resume, log, timeout_s)
        ckpt, plan, cluster = trained.checkpoint, trained.plan, trained.cluster
        stage["train_s"] = time.monotonic() - t
        metrics_path = write_step_metrics(plan)
        steps = read_metrics(metrics_path)
        if feed is not None:
            feed.final = steps
    if nodes is not None:
        runner = node_runner(provider, cluster, cluster.nodes[0])  # node 0 of the nodes the run ended on
    last = steps[-1]
    if last.step < plan.total_steps:
        raise XTunerLaunchError(
            f"train stopped at step {last.step} of {plan.total_steps}; log: {plan.log_dir}/train.log"
        )
    conv: dict[str, str | None] = {}
    if convert:
        t = time.monotonic()
        conv = _convert(spec, plan, ckpt, run_dir, publish_to, runner, log)
        stage["convert_s"] = time.monotonic() - t
    result = _result(plan, steps, ckpt, metrics_path, conv, stats, stage, trained, cluster, nodes, t0)
    atomic_write_text(RunFiles(run_dir).result, result.model_dump_json(indent=2) + "\n")
    return result
