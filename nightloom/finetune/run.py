"""Fine-tune with XTuner from a RunSpec: check → render → prepare data → launch → metrics → convert → publish.

`run_xtuner` is the one pure entry the pipeline calls when `train.backend == "xtuner"`; the stages
(`plan_xtuner`, `prepare_data`, `launch_training`, `convert_checkpoint`) are public so Prefect tasks can wrap
each with its own retries and artifacts. Everything that can be wrong with the inputs fails in
`plan_xtuner`, before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from nightloom.finetune import config as xcfg
from nightloom.finetune.base_model import BaseSource, base_source, check_source, check_tokenizer, fetch_cached
from nightloom.finetune.convert import check_hf_model, find_checkpoint, merge_lora, pth_to_hf, publish
from nightloom.finetune.env import XTunerEnv, ensure_env
from nightloom.finetune.launcher import (
    WRAPPER,
    Runner,
    XTunerLaunchError,
    check,
    local_runner,
    node_env,
    run_streaming,
    tail,
    tool_command,
    train_args,
    train_command,
)
from nightloom.finetune.logs import RunShape, write_metrics
from nightloom.finetune.node_wrapper import EXIT_EMPTY_DATASET
from nightloom.finetune.remote import (
    NodeEnv,
    ensure_node_envs,
    ensure_node_models,
    is_remote,
    node_peak,
    node_runner,
    profile_of,
    wrapper_path,
)
from nightloom.provision.base import Cluster, PreflightReport, ProvisionError, follow
from nightloom.provision.shared_folder import check_shared_folder
from nightloom.runfiles import RunFiles
from nightloom.sharding.storage import S3Config
from nightloom.spec import RunSpec
from nightloom.train.job import TrainResult
from nightloom.util import atomic_write_text

Log = Callable[[str], None]


class XTunerPlan(BaseModel):
    """A checked, rendered XTuner run: where everything is and what one step means."""

    model_config = ConfigDict(extra="forbid")
    python: str
    env_key: str
    profile: str
    method: str
    merge_lora: bool
    base_model: str
    run_dir: str
    config_path: str
    work_dir: str
    processed_dir: str
    log_dir: str
    world_size: int
    micro_batch: int = 0  # sequences per forward pass
    micro_batches: int = 1  # forward/backward passes per rank per step
    total_steps: int
    tokens_per_step: int
    flops_per_token: float | None = None
    peak_flops: float | None = None
    peak_source: str | None = None
    deepspeed: str | None = None
    data_files: list[str]
    prepare_key: str
    wrapper: str = str(WRAPPER)  # node_wrapper.py as the nodes see it (remote.wrapper_path)
    node_pythons: dict[str, str] = Field(default_factory=dict)  # node name -> its XTuner env's interpreter


class XTunerInterruption(BaseModel):
    """One failure recovered from (or given up on): what preflight found, and the world before and after."""

    attempt: int
    kind: str
    detail: str
    at: datetime
    recovery_s: float | None = None  # failure detected -> relaunch started
    world_before: int
    world_after: int | None = None

    @classmethod
    def of(cls, e) -> XTunerInterruption:
        """From a nightloom.recovery.Event."""
        return cls(
            attempt=e.attempt,
            kind=e.kind,
            detail=e.detail,
            at=e.at,
            recovery_s=e.recovery_s,
            world_before=e.world_before,
            world_after=e.world_after,
        )


class XTunerResult(TrainResult):
    """TrainResult plus where XTuner put things (a TrainResult to the rest of the pipeline)."""

    metrics_path: str
    config_path: str
    model_dir: str | None = None  # Hugging Face model (merged when LoRA and merge_lora) or adapter
    adapter_dir: str | None = None
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


# ------------------------------------------------------------------------------------------------ inputs


def shard_files(spec: RunSpec, manifest) -> list[Path]:
    """Local shard paths from a manifest folder/file path, or a ShardManifest read from `spec.sharding.output`."""
    from nightloom.sharding.manifest import MANIFEST_NAME, ShardManifest, load_manifest

    if isinstance(manifest, ShardManifest):
        base, m = spec.sharding.output, manifest
    else:
        base = str(manifest)
        if base.endswith(".json"):
            base = str(Path(base).parent)
        m = load_manifest(base)
    if base.startswith("s3://"):
        raise xcfg.XTunerConfigError(
            f"dataset: shards at {base}: the XTuner backend reads local shards; stage them with nightloom.sharding first"
        )
    root = Path(base)
    if root.name == MANIFEST_NAME:
        root = root.parent
    return [root / s.path for s in sorted(m.shards, key=lambda s: s.index)]


def _base_config(src: BaseSource, base: Path, xdir: Path, spec: RunSpec) -> Path:
    """The base model's config.json as this machine sees it: in the folder, or (a node's cache this machine
    does not share) fetched from the s3:// source."""
    cfg = base / "config.json"
    if cfg.is_file() or not src.is_s3:
        return cfg
    from nightloom.sharding import storage

    return storage.get_file(
        storage.join(src.uri, "config.json"), xdir / "base_config.json", S3Config.from_spec(spec.storage)
    )


def _hf_flops_per_token(config: Path, seq_len: int, frozen_base: bool = False) -> float | None:
    """PaLM FLOPs/token (nightloom.perf) from the base model's config.json (nightloom.hf.config parses it);
    None when it cannot be read or describes an architecture nightloom does not know.
    frozen_base for LoRA/QLoRA (no gradients for the base weights)."""
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.perf import flops_per_token

    try:
        shape = shape_from_hf_config(config, strict=False)
    except ValueError:
        return None
    return flops_per_token(shape, seq_len, frozen_base=frozen_base)


def _peak(spec: RunSpec, profile: str, peak_flops: float | None) -> tuple[float | None, str | None]:
    if peak_flops is not None:
        return peak_flops, "given"
    from nightloom.catalog import GPU_ALIASES, GPUS
    from nightloom.perf import resolve_peak, resolve_precision

    gpu = GPU_ALIASES.get(spec.cluster.gpu_type.lower(), spec.cluster.gpu_type.lower())
    if gpu in GPUS:
        peak = resolve_peak(gpu, resolve_precision("auto", profile))
        return peak.flops, peak.source
    if profile == "cpu":
        from nightloom.perf import measure_cpu_matmul_peak

        m = measure_cpu_matmul_peak(n=512, repeats=3)
        return m.flops, m.source
    return None, None


def _prepare_key(files: list[Path], rendered_values: dict) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(json.dumps(rendered_values, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")


def build_tiny_model(env: XTunerEnv, out: Path, log: Log = print) -> Path:
    """A tiny random Llama + tokenizer at `out`, built by the XTuner env (demo and tests; no hub access)."""
    import subprocess

    r = subprocess.run(
        [str(env.python), str(TINY_MODEL_SCRIPT), str(out)], capture_output=True, text=True, timeout=600, check=False
    )
    if r.returncode != 0:
        raise xcfg.XTunerConfigError(f"train.xtuner.build_tiny_base_model: building {out} failed: {r.stderr[-800:]}")
    log(f"xtuner: built the tiny base model at {out}")
    return out


def plan_xtuner(
    spec: RunSpec,
    manifest,
    run_dir: str | Path,
    *,
    world_size: int | None = None,
    env: XTunerEnv | None = None,
    peak_flops: float | None = None,
    log: Log = print,
    base_path: str | None = None,
    micro_batch: int | None = None,
) -> XTunerPlan:
    """Check every input, find or build the env, and render the config. Raises XTunerConfigError before launch.
    `base_path`: the base model's folder where the nodes fetched it (default: resolved on this machine).
    `micro_batch`: sequences per forward (default train.xtuner.micro_batch, else global_batch / world_size);
    recovery passes the first plan's, so fewer ranks accumulate more passes and a step stays the same."""
    xs = spec.train.xtuner
    if xs is None:
        raise xcfg.XTunerConfigError("train.xtuner: required when train.backend is 'xtuner'")
    tr = spec.train
    map_fn = xcfg.resolve_map_fn(xs.map_fn)
    template = xcfg.check_template(xs.template)
    src = base_source(spec)
    if base_path is not None:  # fetched on the nodes and checked there (remote.ensure_node_models)
        base = Path(base_path)
    elif src.is_s3:
        base = Path(fetch_cached(src.uri, s3=S3Config.from_spec(spec.storage), log=log).path)
    else:
        if xs.build_tiny_base_model and not Path(src.uri).exists():
            env = env or ensure_env(python=xs.python, log=log)
            build_tiny_model(env, Path(src.uri), log)
        check_source(src)
        base = Path(src.uri)
    tokenizer = check_tokenizer(src.tokenizer) if src.tokenizer else None
    files = shard_files(spec, manifest)
    data_format = xcfg.check_data_files(files, map_fn)
    world = world_size or spec.world_size
    passes = xcfg.micro_batches(
        tr.global_batch, world, micro_batch or xs.micro_batch, xs.zero_stage, xs.sequence_parallel_size
    )
    env = env or ensure_env(python=xs.python, log=log)
    profile = env.profile if env.profile in ("cpu", "gpu") else ("gpu" if env.versions.get("cuda") else "cpu")
    xcfg.check_profile(profile, xs.method, xs.zero_stage, xs.sequence_parallel_size)

    run_dir = Path(run_dir).resolve()
    xdir = run_dir / "xtuner"
    save_steps = tr.checkpoint_every or tr.steps
    inputs = xcfg.RenderInputs(
        profile=profile,
        method=xs.method,
        base_model=str(base),
        tokenizer_path=str(tokenizer) if tokenizer else None,
        data_files=[str(f) for f in files],
        data_format=data_format,
        map_fn=map_fn,
        template=template,
        work_dir=str(xdir / "work_dir"),
        processed_dir=str(xdir / "processed"),
        hf_cache_dir=str(xdir / "hf_cache"),
        max_length=tr.seq_len,
        batch_size=tr.global_batch // world,
        micro_batches=passes,
        sampler_pad_to=world * passes,
        max_iters=tr.steps,
        warmup_iters=min(tr.warmup_steps, tr.steps),
        lr=tr.lr,
        min_lr_ratio=tr.min_lr_ratio,
        weight_decay=tr.weight_decay,
        max_norm=tr.grad_clip,
        save_steps=save_steps,
        seed=tr.seed,
        dist_timeout_s=tr.collective_timeout_s,
        amp_dtype="float16" if xs.amp == "fp16" else "bfloat16",
        sequence_parallel_size=xs.sequence_parallel_size,
    )
    cfg_path = xcfg.render_config(inputs, xdir / "config.py")
    pkey_values = {
        k: v
        for k, v in inputs.values().items()
        if k
        in (
            "base_model",
            "tokenizer_path",
            "data_files",
            "map_fn_name",
            "template_name",
            "max_length",
            "pack_to_max_length",
            "seed",
        )
    }
    peak, peak_source = _peak(spec, profile, peak_flops)
    return XTunerPlan(
        python=str(env.python),
        env_key=env.key,
        profile=profile,
        method=xs.method,
        merge_lora=xs.merge_lora,
        base_model=str(base),
        run_dir=str(run_dir),
        config_path=str(cfg_path),
        work_dir=inputs.work_dir,
        processed_dir=inputs.processed_dir,
        log_dir=str(xdir / "logs"),
        world_size=world,
        micro_batch=tr.global_batch // world // passes,
        micro_batches=passes,
        total_steps=tr.steps,
        tokens_per_step=tr.global_batch * tr.seq_len,
        flops_per_token=_hf_flops_per_token(
            _base_config(src, base, xdir, spec), tr.seq_len, frozen_base=xs.method != "full"
        ),
        peak_flops=peak,
        peak_source=peak_source,
        deepspeed=f"deepspeed_zero{xs.zero_stage}" if xs.zero_stage else None,
        data_files=inputs.data_files,
        prepare_key=_prepare_key(files, pkey_values),
    )


def plan_for_world(
    spec: RunSpec, manifest, first: XTunerPlan, world: int, *, env=None, base_path=None, log: Log = print
) -> XTunerPlan:
    """The config for `world` ranks after recovery: the first plan's micro-batch, so each rank accumulates the
    forwards of the ranks that left and a step's gradient is kept; where that cannot be (DeepSpeed, or a world
    the micro-batch does not fit, as 3 ranks -> 2), each rank takes global_batch / world at once (said in the log)."""
    again = dict(world_size=world, env=env, peak_flops=first.peak_flops, base_path=base_path or first.base_model)
    try:
        return plan_xtuner(spec, manifest, first.run_dir, micro_batch=first.micro_batch, **again)
    except xcfg.XTunerConfigError as e:
        log(f"xtuner: {e}; the {world} rank(s) take global_batch / world size each instead (steps differ)")
        whole = spec.train.global_batch // world if spec.train.global_batch % world == 0 else None
        return plan_xtuner(spec, manifest, first.run_dir, micro_batch=whole, **again)


# ------------------------------------------------------------------------------------------------ stages


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


def launch_training(
    plan: XTunerPlan,
    *,
    cluster=None,
    provider=None,
    resume: bool = True,
    log: Log = print,
    timeout_s: float | None = None,
) -> Path:
    """Run XTuner's train tool (1 rank, local torchrun, or the provider's nodes); return the final checkpoint.

    Success needs exit code 0 AND a checkpoint AND the last step logged: XTuner can exit 0 without work.
    Recovery without a spec: only the known intermittent abort is relaunched (`train_with_recovery`)."""
    return train_with_recovery(
        plan, cluster=cluster, provider=provider, resume=resume, log=log, timeout_s=timeout_s
    ).checkpoint


#: An intermittent C++ abort seen on CPU/gloo while mmengine saves a checkpoint (rank 1, after the step's work).
UPSTREAM_ABORT = "terminate called without an active exception"
UPSTREAM_ABORT_RETRIES = 1
#: failure signals a relaunch can cure (a rank killed, a dead peer's collective timing out); a plain crash
#: on healthy nodes ("exit") would repeat, so it is raised
RECOVERABLE_SIGNALS = ("killed", "collective-timeout", "stall")


@dataclass
class Trained:
    """How training ended after recovery: the final checkpoint, the plan and cluster of the last attempt,
    and one recovery Event per interruption (the ledger's rows)."""

    checkpoint: Path
    plan: XTunerPlan
    cluster: object | None
    events: list = field(default_factory=list)


def known_abort(launch_text: str, diag) -> bool:
    """The attempt ended in the known gloo abort, on nodes preflight still finds healthy."""
    return UPSTREAM_ABORT in launch_text and not (diag is not None and diag.kind == "node")


def relaunch_reason(
    failure, diag, launch_text: str, relaunches: int, max_relaunches: int, aborts: int = 0
) -> str | None:
    """None when the failed attempt is relaunched, else why not. The known gloo abort on healthy nodes is a
    transient failure with a budget of its own (UPSTREAM_ABORT_RETRIES relaunches, `aborts` used so far), so a
    node recovery earlier in the run does not leave it fatal, then within recovery.max_attempts like any other
    failure (`relaunches` used: relaunches not paid by the abort's budget), which is relaunched when preflight
    found a bad node or the signal is one a relaunch can cure."""
    node_failure = diag is not None and diag.kind == "node"
    abort = known_abort(launch_text, diag)
    if abort and aborts < UPSTREAM_ABORT_RETRIES:
        return None
    if relaunches >= max_relaunches:
        spent = f" (and the known gloo abort's own {UPSTREAM_ABORT_RETRIES})" if abort else ""
        return f"out of attempts: {relaunches} of recovery.max_attempts={max_relaunches} relaunches used{spent}"
    if abort:  # again, past its own budget: a transient failure within recovery.max_attempts
        return None
    if node_failure:
        return None
    if failure.signal in RECOVERABLE_SIGNALS:
        return None
    return f"{failure.signal} on healthy nodes ({diag.kind if diag else 'no preflight'}): a relaunch would repeat it"


def train_with_recovery(
    plan: XTunerPlan,
    *,
    cluster=None,
    provider=None,
    resume: bool = True,
    log: Log = print,
    timeout_s: float | None = None,
    max_relaunches: int = 0,
    min_nodes: int = 1,
    allow_relayout: bool = True,
    replan: Callable | None = None,
    on_cluster: Callable | None = None,
) -> Trained:
    """Train; on a failure re-run preflight on the nodes (when there is a provider), classify it
    (nightloom.recovery), exclude bad nodes (`provider.reacquire`: spares where the provider has them),
    ready the new nodes and re-render for their world size (`replan(cluster) -> XTunerPlan`) and resume from XTuner's last
    checkpoint, within `max_relaunches`; raise the last XTunerLaunchError when it must stop.
    `on_cluster(cluster)` is called with every cluster reacquired (the caller must release it on failure)."""
    from nightloom import recovery as rec

    events: list = []
    relaunches = aborts = 0  # relaunches so far; of them, for the known gloo abort (a budget of its own)
    while True:
        log_file = Path(plan.log_dir) / "train.log"
        seen = log_file.stat().st_size if log_file.exists() else 0
        if events and events[-1].recovery_s is None:
            events[-1].recovery_s = round(time.time() - events[-1].at.timestamp(), 3)  # detection -> relaunch
        try:
            ckpt = _launch_once(
                plan, cluster=cluster, provider=provider, resume=resume or relaunches > 0, log=log, timeout_s=timeout_s
            )
            return Trained(ckpt, plan, cluster, events)
        except (XTunerLaunchError, TimeoutError) as err:
            at = time.time()
            text = ""
            if log_file.exists():
                with open(log_file, encoding="utf-8", errors="replace") as f:
                    f.seek(seen)
                    text = f.read()
            cause = next((x for x in reversed(text.splitlines()) if x.strip()), str(err))[-500:]
            failure = rec.AttemptFailure(relaunches, getattr(err, "code", None), False, cause, None, at_unix=at)
            diag = None
            if provider is not None and cluster is not None:
                try:
                    report = provider.preflight(cluster)
                except Exception as e:  # noqa: BLE001 - no report: classified transient, named in the detail
                    report = PreflightReport(nodes=[], unknown=f"preflight crashed: {type(e).__name__}: {e}")
                diag = rec.classify(failure, report)
            is_abort = known_abort(text, diag)
            why = relaunch_reason(failure, diag, text, relaunches - aborts, max_relaunches, aborts)
            world_before = plan.world_size
            if why is None and diag is not None and diag.bad_nodes:
                nxt = provider.reacquire(cluster, diag.bad_nodes)
                if on_cluster is not None:
                    on_cluster(nxt)
                why = rec.relayout_reason(
                    cluster.world_size, nxt.world_size, len(nxt.nodes), min_nodes, allow_relayout and bool(replan)
                )
                if why is None:
                    try:
                        plan = replan(nxt)
                    except ProvisionError as e:  # a new node: no run folder, or its XTuner env failed
                        why = str(e)
                    except Exception as e:  # noqa: BLE001 - XTunerConfigError (batch not divisible...): the reason
                        why = f"no XTuner config for {nxt.world_size} rank(s): {e}"
                if why is None:
                    cluster = nxt
            kind = diag.kind if diag is not None else ("transient" if UPSTREAM_ABORT in text else failure.signal)
            detail = diag.detail if diag is not None else f"{failure.signal}: {cause}"
            ev = rec.Event(relaunches, kind, detail, datetime.fromtimestamp(at, UTC), world_before=world_before)
            events.append(ev)
            if why is not None:
                ev.detail += f"; gave up: {why}"
                err.events = events  # the interruptions so far, for the ledger
                raise
            ckpt = find_checkpoint(Path(plan.work_dir))
            ev.world_after = plan.world_size
            nodes = ", ".join(n.name for n in cluster.nodes) if cluster is not None else "this machine"
            ev.detail += f"; resumed from {ckpt.name if ckpt else 'the start'} on {nodes}"
            log(f"xtuner: recovery {relaunches + 1}: {kind}: {detail[:300]}; relaunching on {nodes}")
            relaunches += 1
            aborts += is_abort and aborts < UPSTREAM_ABORT_RETRIES


def _launch_once(plan: XTunerPlan, *, cluster, provider, resume: bool, log: Log, timeout_s: float | None) -> Path:
    """One launch of XTuner's train tool; raises XTunerLaunchError on failure."""
    work_dir = Path(plan.work_dir)
    ckpt = find_checkpoint(work_dir) if resume else None
    if ckpt is not None:
        log(f"xtuner: resuming from {ckpt}")
    log_file = Path(plan.log_dir) / "train.log"
    if cluster is not None and provider is not None:
        nodes = [n.model_copy(update={"python": plan.node_pythons.get(n.name, plan.python)}) for n in cluster.nodes]
        launch = provider.launch(
            cluster.model_copy(update={"nodes": nodes}),
            train_args(
                Path(plan.config_path), distributed=True, resume=ckpt, deepspeed=plan.deepspeed, wrapper=plan.wrapper
            ),
            node_env(),
        )
        log_file.parent.mkdir(parents=True, exist_ok=True)

        with open(log_file, "a", encoding="utf-8") as f:

            def line(text: str) -> None:
                f.write(text + "\n")
                f.flush()
                log(f"[train] {text}")

            code = follow(launch, line, timeout=timeout_s, note=lambda m: log(f"xtuner: {m}"))
    else:
        from nightloom.provision.local import free_port

        cmd = train_command(
            plan.python,
            Path(plan.config_path),
            plan.world_size,
            master_port=free_port(),
            resume=ckpt,
            deepspeed=plan.deepspeed,
            distributed=plan.micro_batches > 1,  # one rank accumulating: only the DDP wrapper cuts its batch
        )
        code = run_streaming(cmd, log_file, log, step="train", timeout_s=timeout_s)
    check(code, "train", log_file)
    final = find_checkpoint(work_dir)
    if final is None:
        raise XTunerLaunchError(f"train exited 0 but left no checkpoint in {work_dir}; log: {log_file}")
    return final


def write_step_metrics(plan: XTunerPlan, attempt: int = 0) -> Path:
    """metrics.jsonl in the run dir from every launch's mmengine logs."""
    out = RunFiles(plan.run_dir).metrics
    shape = RunShape(plan.tokens_per_step, plan.flops_per_token, plan.world_size, plan.peak_flops)
    write_metrics(Path(plan.work_dir), out, shape, attempt)
    return out


def convert_checkpoint(
    plan: XTunerPlan,
    checkpoint: Path,
    *,
    log: Log = print,
    publish_to: str | None = None,
    s3_endpoint_url: str | None = None,
    runner: Runner | None = None,
) -> dict[str, str | None]:
    """pth → HF (adapter for LoRA), merge when asked, then publish the final model folder. `runner`: where the
    XTuner env runs the tools (node 0, the node whose rank 0 wrote the checkpoint, for remote clusters)."""
    run_dir = Path(plan.run_dir)
    log_file = Path(plan.log_dir) / "convert.log"
    lora = plan.method in ("lora", "qlora")
    hf = pth_to_hf(
        plan.python,
        Path(plan.config_path),
        checkpoint,
        run_dir / ("adapter" if lora else "model"),
        lora=lora,
        log_file=log_file,
        log=log,
        runner=runner,
        wrapper=plan.wrapper,
    )
    out: dict[str, str | None] = {"adapter_dir": str(hf) if lora else None, "model_dir": None if lora else str(hf)}
    if lora and plan.merge_lora:
        merged = merge_lora(
            plan.python,
            Path(plan.base_model),
            hf,
            run_dir / "model",
            device="cpu" if plan.profile == "cpu" else "cuda",
            log_file=log_file,
            log=log,
            runner=runner,
            wrapper=plan.wrapper,
        )
        out["model_dir"] = str(check_hf_model(merged))
    final = out["model_dir"] or out["adapter_dir"]
    out["published"] = publish(Path(final), publish_to, s3_endpoint_url) if publish_to else final
    return out


# ------------------------------------------------------------------------------------------------ entry


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
    `cluster`/`provider`: launch on the provider's nodes (their interpreters replaced by the XTuner env's);
    without them, ranks run on this machine (world size = cluster.world_size or spec.world_size).
    `publish_to`: local folder or s3:// prefix for the final model; default: s3 storage roots get
    `<root>/<spec.name>/<run_dir name>/model`, local ones keep it in `<run_dir>/model`.
    """
    t0 = time.monotonic()
    stage: dict[str, float] = {}
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    world = cluster.world_size if cluster is not None else spec.world_size
    runner: Runner | None = None
    node_envs: dict[str, NodeEnv] = {}
    xs = spec.train.xtuner
    if is_remote(cluster):  # the XTuner env on every node; XTuner's tools run on node 0
        node_envs = ensure_node_envs(
            provider, cluster, profile_of(spec.cluster.gpu_type), python=spec.train.xtuner.python, log=log
        )
        env = node_envs[cluster.nodes[0].name].as_env()
        runner = node_runner(provider, cluster, cluster.nodes[0])
        stage["node_env_s"] = time.monotonic() - t0
    src = base_source(spec)
    base_path: str | None = None
    endpoint = S3Config.from_spec(spec.storage).endpoint()
    if is_remote(cluster) and src.is_s3:  # the base model in every node's cache, fetched there once
        t = time.monotonic()
        base_path = ensure_node_models(provider, cluster, src.uri, endpoint, log=log)
        stage["base_model_s"] = time.monotonic() - t
    plan = plan_xtuner(
        spec, manifest, run_dir, world_size=world, env=env, peak_flops=peak_flops, log=log, base_path=base_path
    )
    if is_remote(cluster):
        pythons = {name: e.python for name, e in node_envs.items()}
        plan = plan.model_copy(update={"wrapper": wrapper_path(cluster), "node_pythons": pythons})
        if plan.profile == "gpu" and peak_flops is None:  # the catalog peak of the GPU node 0 reports
            peak = node_peak(node_envs[cluster.nodes[0].name])
            plan = plan.model_copy(update={"peak_flops": peak.flops, "peak_source": peak.source})
    stage["plan_s"] = time.monotonic() - t0
    t = time.monotonic()
    stats = prepare_data(plan, log=log, runner=runner)
    stage["prepare_s"] = time.monotonic() - t
    t = time.monotonic()

    rendered = [plan]  # every plan rendered to config.py, the last one in force

    def replan(nxt: Cluster) -> XTunerPlan:
        """After recovery changed the nodes: the XTuner env on any new one, the config for the new world size."""
        new = [n for n in nxt.nodes if n.name not in node_envs]
        if new:
            sub = nxt.model_copy(update={"nodes": new})
            check_shared_folder(provider, sub, run_dir)  # a spare must see the run folder as the others do
            node_envs.update(
                ensure_node_envs(provider, sub, profile_of(spec.cluster.gpu_type), python=xs.python, log=log)
            )
            if base_path is not None and ensure_node_models(provider, sub, src.uri, endpoint, log=log) != base_path:
                raise xcfg.XTunerConfigError(f"model.weights: the new nodes cache {src.uri} at another path")
        p = rendered[-1]  # config.py is one file: compare with the world it was last rendered for
        if nxt.world_size != p.world_size:
            p = plan_for_world(spec, manifest, plan, nxt.world_size, env=env, base_path=base_path, log=log)
            rendered.append(p)
        return p.model_copy(
            update={"wrapper": wrapper_path(nxt), "node_pythons": {n: e.python for n, e in node_envs.items()}}
        )

    held: list[Cluster] = []  # clusters recovery reacquired: released here if the run fails after them
    try:
        trained = train_with_recovery(
            plan,
            cluster=cluster,
            provider=provider,
            resume=resume,
            log=log,
            timeout_s=timeout_s,
            max_relaunches=spec.recovery.max_attempts if cluster is not None else 0,
            min_nodes=spec.cluster.min_nodes or 1,
            allow_relayout=spec.recovery.allow_relayout,
            replan=replan if is_remote(cluster) else None,
            on_cluster=held.append,
        )
    except BaseException:
        for c in held:
            if c.handle != cluster.handle:  # a new allocation (slurm): the caller only knows the first one
                provider.release(c)
        raise
    ckpt, plan, cluster = trained.checkpoint, trained.plan, trained.cluster
    if is_remote(cluster):
        runner = node_runner(provider, cluster, cluster.nodes[0])  # node 0 of the nodes the run ended on
    stage["train_s"] = time.monotonic() - t
    metrics_path = write_step_metrics(plan)
    from nightloom.metrics import read_metrics

    steps = read_metrics(metrics_path)
    last = steps[-1]
    if last.step < plan.total_steps:
        raise XTunerLaunchError(
            f"train stopped at step {last.step} of {plan.total_steps}; log: {plan.log_dir}/train.log"
        )
    conv: dict[str, str | None] = {}
    if convert:
        t = time.monotonic()
        if publish_to is None and spec.storage.root.startswith("s3://"):
            publish_to = f"{spec.storage.root.rstrip('/')}/{spec.name}/{run_dir.name}/model"
        conv = convert_checkpoint(
            plan, ckpt, log=log, publish_to=publish_to, s3_endpoint_url=spec.storage.s3_endpoint_url, runner=runner
        )
        stage["convert_s"] = time.monotonic() - t
    result = XTunerResult(
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
        node_ready_s={k: e.ready_s for k, e in node_envs.items()},
        node_env_cold={k: e.created for k, e in node_envs.items()},
    )
    atomic_write_text(RunFiles(run_dir).result, result.model_dump_json(indent=2) + "\n")
    return result
