"""The whole run as one Prefect flow: shard → gate → provision → plan → train → validate → record.

Teardown of the cluster is guaranteed: `finally` for failures inside the flow, and state hooks (which
read the run's teardown record from disk) for crashes and cancellations from the UI.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as current_run

from flows.shard import shard_dataset_flow
from nightloom.catalog import ModelShape, get_gpu, get_model
from nightloom.hf.export import tokenizer_source
from nightloom.report import RunSummary, StageTime
from nightloom.schedule import BillingSpan, RunRefused, next_window
from nightloom.spec import RunSpec, coerce_spec
from nightloom.tokenizer import resolve_vocab
from nightloom.train.job import ModelConfig, TrainJob
from nightloom.validate import ValidationFailed
from tasks.finetune import xtuner_train_task
from tasks.gate import gate_task, schedule_same_deployment
from tasks.nights import night_record, record_night_task
from tasks.plan import plan_task
from tasks.provision import acquire_cluster, make_provider, release_cluster
from tasks.record import fail_record_task, record_task, start_record_task
from tasks.recovery import train_with_recovery
from tasks.teardown import kill_recorded_processes, record_cluster, teardown_hook
from tasks.validate import validate_task


class Stopwatch:
    """Wall time per stage, for the summary and the closing report."""

    def __init__(self) -> None:
        self.stages: list[StageTime] = []

    @contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages.append(StageTime(stage=name, seconds=round(time.perf_counter() - t0, 2)))


def model_shape(spec: RunSpec) -> ModelShape:
    if spec.model.build_demo_weights and spec.model.weights:
        from nightloom.hf.random_model import ensure_demo_weights

        ensure_demo_weights(spec.model.weights)
    if spec.model.config:
        from nightloom.catalog import shape_from_hf_config

        return shape_from_hf_config(spec.model.config)
    return get_model(spec.model.name)


def make_run_id(spec: RunSpec) -> str:
    fr = current_run.get_id()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{spec.name}-{stamp}-{(fr or 'local')[:8]}"


@contextmanager
def cluster_lock(name: str):
    """One run per cluster: a strict Prefect global concurrency limit named after the cluster."""
    from prefect import get_client
    from prefect.concurrency.sync import concurrency

    limit = f"cluster-{name}"
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(limit, 1)
    with concurrency(limit, occupy=1, strict=True):
        yield


def continue_in_next_window(spec: RunSpec, run_id: str, now: datetime | None) -> tuple[str, str | None]:
    """Schedule the continuation of a split run at the next window start (same run id: resumes its checkpoint)."""
    start = next_window(spec.schedule, now or datetime.now(UTC)).start.astimezone(ZoneInfo(spec.schedule.timezone))
    params = {"spec": spec.model_dump(mode="json", by_alias=True), "resume_run_id": run_id}
    return start.isoformat(), schedule_same_deployment(params, start)


@flow(name="training-pipeline", log_prints=True, on_cancellation=[teardown_hook], on_crashed=[teardown_hook])
def training_pipeline(
    spec: RunSpec | str,
    resume_run_id: str | None = None,
    now: datetime | None = None,
) -> RunSummary:
    """Run one spec end to end. `spec` is a RunSpec (the UI form) or a path to a spec YAML.

    `resume_run_id` continues a split or interrupted run in its folder (checkpoints, metrics, ledger row).
    `now` overrides the clock for the window gate (tests).
    """
    log = get_run_logger()
    spec = coerce_spec(spec)
    watch = Stopwatch()
    run_id = resume_run_id or make_run_id(spec)
    run_dir = Path(spec.storage.root) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = RunSummary(run_id=run_id, name=spec.name, status="failed", run_dir=str(run_dir))
    shape = model_shape(spec)

    with watch.stage("shard"):
        manifest = shard_dataset_flow(spec)
    shape = shape.with_(vocab=resolve_vocab(spec.model, shape.vocab))  # a train_vocab tokenizer exists now
    summary.shards, summary.shard_imbalance = manifest.num_shards, manifest.imbalance
    summary.shards_balanced = manifest.balanced

    with watch.stage("gate"):
        pre_plan = plan_task(spec, spec.world_size, publish=False)
        try:
            decision = gate_task(spec, pre_plan, shape, run_id=run_id, now=now)
        except RunRefused as e:  # over budget or max_nights: refused before renting; the ledger keeps it
            start_record_task(spec, run_id, pre_plan, resume=resume_run_id is not None)
            fail_record_task(spec, run_id, "refused", str(e), 0.0)
            raise
    if not decision.run_now:
        summary.status, summary.reason = decision.status, decision.reason
        summary.next_run_at = decision.next_run_at
        summary.stages = watch.stages
        log.info("not running now: %s", decision.reason)
        return summary

    ledger_id = start_record_task(spec, run_id, pre_plan, resume=resume_run_id is not None)
    summary.ledger_id = ledger_id
    started = datetime.now(UTC)
    provider = make_provider(spec)
    cluster = None
    result = None
    try:
        with cluster_lock(spec.cluster.name):
            with watch.stage("provision"):
                cluster = acquire_cluster(provider)
                record_cluster(run_dir, cluster)
            with watch.stage("plan"):
                plan = plan_task(spec, cluster.world_size)
            summary.layout, summary.world_size = plan.layout(), cluster.world_size
            summary.mfu_predicted = plan.mfu
            job = TrainJob(
                run_id=run_id,
                run_dir=str(run_dir),
                model=ModelConfig.from_shape(shape),
                plan=plan,
                train=spec.train,
                manifest=spec.sharding.output,
                s3_endpoint_url=spec.storage.s3_endpoint_url,
                peak_flops=None,
                peak_source=None,
                deadline_unix=decision.deadline_unix,
                stop_after_steps=decision.stop_after_steps,
                weights=spec.model.weights,
                hf_config=spec.model.config,
                tokenizer_dir=tokenizer_source(spec),
                tokenizer=spec.model.tokenizer,
                eval_every=spec.validate_.eval_every,
                eval_windows=spec.validate_.eval_windows,
                eval_data=spec.validate_.eval_data,
            )
            if spec.cluster.gpu_type != "cpu":
                gpu = get_gpu(spec.cluster.gpu_type)
                precision = "fp32" if spec.train.precision == "fp32" else "bf16"
                job.peak_flops, job.peak_source = gpu.peak(precision), f"datasheet: {gpu.source}"
            first_gpus, provisioning_s = cluster.world_size, cluster.time_to_ready_s
            with watch.stage("train"):
                if spec.train.backend == "xtuner":
                    train_start = datetime.now(UTC)
                    result = xtuner_train_task(spec, spec.sharding.output, str(run_dir), cluster, provider)
                    spans = [BillingSpan(train_start, result.wall_s, cluster.world_size)]
                else:
                    trained = train_with_recovery(spec, provider, cluster, job)
                    result, cluster, plan, spans = trained.result, trained.cluster, trained.plan, trained.spans
                    summary.layout, summary.world_size = plan.layout(), cluster.world_size
                    summary.interruptions, summary.recovery_s = trained.interruptions, round(trained.recovery_s, 2)
                    summary.export_dir = result.export_dir
    except BaseException as e:
        status = "cancelled" if isinstance(e, (KeyboardInterrupt, SystemExit)) else "failed"
        fail_record_task(spec, run_id, status, f"{type(e).__name__}: {e}", sum(x.seconds for x in watch.stages))
        raise
    finally:
        with watch.stage("teardown"):
            release_cluster(provider, cluster)
            kill_recorded_processes(run_dir)

    try:  # a crash here must still close the ledger row (never leave it "running")
        with watch.stage("validate"):
            outcome = validate_task(spec, run_dir, plan, result, shape, cluster.world_size)
        night = night_record(spec, decision, started, provisioning_s, first_gpus, spans, result)
        nights = record_night_task(spec, run_id, decision, night)
        cost = nights.run_cost  # every night of the run, this one included
        summary.nights_used, summary.nights_left = nights.nights_used, nights.nights_left
        summary.predicted_finish = nights.predicted_finish
        status = "succeeded" if outcome.passed else "failed"
        summary.status = "completed" if outcome.passed else "failed"
        if result.stopped != "completed" and outcome.passed:
            kind = decision.deadline_kind or "deadline"
            summary.status, status = ("split" if kind == "window" else "stopped"), "stopped"
            summary.reason = (
                f"stopped at the {kind} end after {result.steps_done}/{result.total_steps} steps "
                f"(checkpoint {result.last_checkpoint})"
            )
        with watch.stage("record"):
            summary = record_task(spec, summary, plan, cluster, outcome, cost, watch.stages, status)
    except Exception as e:
        fail_record_task(spec, run_id, "failed", f"{type(e).__name__}: {e}", sum(x.seconds for x in watch.stages))
        raise
    if not outcome.passed:
        raise ValidationFailed([v for v in outcome.verdicts if not v.passed])
    if summary.status == "split" and decision.deadline_kind == "window":
        summary.next_run_at, nxt = continue_in_next_window(spec, run_id, now)
        summary.reason += f"; continues at {summary.next_run_at}" + (f" (flow run {nxt})" if nxt else "")
    return summary
