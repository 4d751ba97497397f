"""The pipeline's stages, so that flows/pipeline.py reads as the run itself.

Each stage is a function or a context manager over tasks: `ledger_row` (the run's ledger row, closed failed or
cancelled by any exception), `rented_cluster` (lock, acquire, record; release and kill on the way out, however
it is left), `train_stage` (native or XTuner, one `TrainOutcome`). The window gate's clock is the real one
except under `clock_at` (tests), so the deployment's Run form carries no test-only field.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from prefect import get_run_logger
from prefect.runtime import flow_run as current_run

from flows.shard import shard_dataset_flow
from nightloom.benchmarks.stage import BenchReport
from nightloom.model_resolver import model_shape as resolve_model_shape
from nightloom.parallel import ParallelPlan
from nightloom.provision.base import Cluster, Provider
from nightloom.provision.shared_folder import check_shared_folder
from nightloom.queue.tonight import StretchPlacement
from nightloom.recovery import Event
from nightloom.report import StageTime
from nightloom.schedule.cost import BillingSpan
from nightloom.schedule.errors import RunRefused
from nightloom.schedule.gate import GateDecision
from nightloom.schedule.night_record import NightsSoFar, night_record
from nightloom.schedule.windows import next_window
from nightloom.shape import ModelShape
from nightloom.sharding import ShardManifest
from nightloom.spec import RunSpec
from nightloom.train.job import TrainJob, TrainOutcome, TrainResult
from tasks.benchmarks import benchmark_task, with_benchmarks
from tasks.finetune import xtuner_train_task
from tasks.gate import gate_task, schedule_same_deployment
from tasks.grpo import completions_artifact_task
from tasks.nights import record_night_task
from tasks.plan import plan_task
from tasks.provision import acquire_cluster, make_provider, release_cluster
from tasks.record import fail_record_task, start_record_task
from tasks.recovery import record_interruption_task, train_with_recovery
from tasks.teardown import kill_recorded_processes, record_cluster
from tasks.validate import ValidationOutcome, validate_task

_clock: ContextVar[datetime | None] = ContextVar("nightloom_clock", default=None)


@contextmanager
def clock_at(now: datetime) -> Iterator[None]:
    """Run the pipeline as if it were `now` (the window gate and the next-window continuation); for tests."""
    token = _clock.set(now)
    try:
        yield
    finally:
        _clock.reset(token)


def clock() -> datetime | None:
    """The injected time (`clock_at`), or None: the real clock."""
    return _clock.get()


_placement: ContextVar[StretchPlacement | None] = ContextVar("nightloom_placement", default=None)


@contextmanager
def placed(p: StretchPlacement) -> Iterator[None]:
    """Run the pipeline as the night queue placed it (flows/queue_night.py): its cluster lock's key, its stretch's
    stop time and the provider options that pin its nodes."""
    token = _placement.set(p)
    try:
        yield
    finally:
        _placement.reset(token)


def _stretch_deadline(decision: GateDecision) -> GateDecision:
    """Under the queue, training stops at the plan's end of the stretch when that comes before the gate's
    deadline (mapped from the gate's clock onto the real one, as the gate maps the window's end)."""
    p = _placement.get()
    if p is None or p.stop_at is None or not decision.run_now:
        return decision
    stop = p.stop_at.timestamp() - (decision.clock_offset_s or 0.0)
    if decision.deadline_unix is not None and decision.deadline_unix <= stop:
        return decision
    return decision.model_copy(update={"deadline_unix": stop, "deadline_kind": "stretch"})


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

    def total(self) -> float:
        return sum(x.seconds for x in self.stages)


def model_shape(spec: RunSpec) -> ModelShape:
    """The model to train: its HF config (building the demo's random weights on first use) or the catalog's, with
    the vocabulary the tokenizer asks for (call after the shard stage: a `train_vocab` tokenizer exists then)."""
    if spec.model.build_demo_weights and spec.model.weights:
        from nightloom.hf.random_model import ensure_demo_weights

        ensure_demo_weights(spec.model.weights, spec.model.config)
    if spec.train.backend == "xtuner":  # a bad or missing base model fails here, before any node is rented
        check_xtuner_base(spec)
    return resolve_model_shape(spec.model)


def check_xtuner_base(spec: RunSpec) -> None:
    """XTuner's base model (model.weights or train.xtuner.base_model; local or s3://) holds a config, a tokenizer
    and weights; a tiny demo model still to be built is checked when it is built."""
    from nightloom.finetune.base_model import base_source, check_source
    from nightloom.storage import S3Config

    src = base_source(spec)
    if not (spec.train.xtuner.build_tiny_base_model and not src.is_s3 and not Path(src.uri).exists()):
        check_source(src, S3Config.from_spec(spec.storage))


def make_run_id(spec: RunSpec) -> str:
    fr = current_run.get_id()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{spec.name}-{stamp}-{(fr or 'local')[:8]}"


def run_folder(spec: RunSpec, run_id: str) -> Path:
    """`<storage.root>/<run_id>`, created (a resumed run reuses its folder)."""
    run_dir = Path(spec.storage.root) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def shard_stage(spec: RunSpec) -> ShardManifest:
    """The shard-dataset subflow. Its result is taken from its state, so Prefect does not link the result's
    parts (strings the spec shares by identity) to later tasks' inputs as a flow-run input: the default UI
    cannot render one (`Invalid TaskInputResponse`) and shows those task pages blank."""
    return shard_dataset_flow(spec, return_state=True).result()


def gate_stage(spec: RunSpec, shape: ModelShape, run_id: str, resume: bool) -> tuple[ParallelPlan, GateDecision]:
    """Plan on the requested size and ask the window gate; a refusal (budget, max_nights) is recorded in the ledger
    (nothing was rented) and raised."""
    pre_plan = plan_task.with_options(task_run_name="pre-plan")(spec, spec.world_size, publish=False)
    try:
        decision = _stretch_deadline(gate_task(spec, pre_plan, shape, run_id=run_id, now=clock()))
    except RunRefused as e:  # over budget or max_nights: refused before renting; the ledger keeps it
        start_record_task(spec, run_id, pre_plan, resume=resume)
        fail_record_task(spec, run_id, "refused", str(e), 0.0)
        raise
    if not decision.run_now:
        get_run_logger().info("not running now: %s", decision.reason)
    return pre_plan, decision


@contextmanager
def ledger_row(spec: RunSpec, run_id: str, plan: ParallelPlan, resume: bool, watch: Stopwatch) -> Iterator[str]:
    """Open (or reopen) the run's ledger row and yield its id; any exception inside closes it failed (cancelled
    for an interrupt) with the error, then propagates: a row is never left `running`."""
    ledger_id = start_record_task(spec, run_id, plan, resume=resume)
    try:
        yield ledger_id
    except BaseException as e:
        _close_row(spec, run_id, e, watch)
        raise


@contextmanager
def failure_recorded(spec: RunSpec, run_id: str, resume: bool, watch: Stopwatch) -> Iterator[None]:
    """The stages before the ledger row is opened (shard, the model's shape): a failure there still gets the
    run's row, opened (no plan yet) and closed failed (cancelled for an interrupt) with the error, which then
    propagates. A ledger that cannot be written is logged, never raised over that error."""
    try:
        yield
    except BaseException as e:
        try:
            start_record_task(spec, run_id, None, resume=resume)
            _close_row(spec, run_id, e, watch)
        except Exception as err:  # noqa: BLE001 - the run's own error is the one to report
            get_run_logger().warning("could not record the failed run %s in the ledger: %s", run_id, err)
        raise


def _close_row(spec: RunSpec, run_id: str, e: BaseException, watch: Stopwatch) -> None:
    """Close the run's ledger row for exception `e`: cancelled for an interrupt, else failed, with the error."""
    status = "cancelled" if isinstance(e, (KeyboardInterrupt, SystemExit)) else "failed"
    fail_record_task(spec, run_id, status, f"{type(e).__name__}: {e}", watch.total())


@contextmanager
def cluster_lock(name: str):
    """One run per cluster: a strict Prefect global concurrency limit named after the cluster. Prefect's upsert reads,
    then creates (not atomic): two runs starting together on one cluster both read nothing and the second create
    gets a 409, so that run upserts again and finds the other's limit."""
    from prefect import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    limit = f"cluster-{name}"
    with get_client(sync_client=True) as client:
        try:
            client.upsert_global_concurrency_limit_by_name(limit, 1)
        except ObjectAlreadyExists:
            client.upsert_global_concurrency_limit_by_name(limit, 1)
    with concurrency(limit, occupy=1, strict=True):
        yield


@dataclass
class Rental:
    """A rented cluster: the provider, the nodes to release (the last cluster the run trained on), the cluster
    as first acquired (its size and time to ready are billed) and when renting began."""

    provider: Provider
    cluster: Cluster
    first: Cluster
    started: datetime


@contextmanager
def rented_cluster(spec: RunSpec, run_dir: Path, watch: Stopwatch) -> Iterator[Rental]:
    """Hold the cluster's lock, acquire and record the nodes (teardown hooks read the record); however the
    block is left, release the nodes and kill the recorded processes."""
    started = datetime.now(UTC)
    placement = _placement.get()
    provider = make_provider(placement.provider_spec(spec) if placement else spec)
    rental: Rental | None = None
    try:
        with cluster_lock(placement.lock_key if placement else spec.cluster.name):
            with watch.stage("provision"):
                cluster = acquire_cluster(provider)
                record_cluster(run_dir, cluster)
                rental = Rental(provider, cluster, cluster, started)
                check_shared_folder(provider, cluster, run_dir)  # ssh/slurm nodes: the run folder is theirs too
            yield rental
    finally:
        with watch.stage("teardown"):
            release_cluster(provider, rental.cluster if rental else None)
            kill_recorded_processes(run_dir)


def train_stage(spec: RunSpec, rental: Rental, job: TrainJob) -> TrainOutcome:
    """Train with the spec's backend: native (with unattended recovery, which may swap nodes and re-plan; the
    rental then follows the cluster the run ends on) or XTuner (one task, the whole backend)."""
    if spec.train.backend == "xtuner":
        start = datetime.now(UTC)
        try:
            result = xtuner_train_task(spec, spec.sharding.output, job.run_dir, rental.cluster, rental.provider)
        except Exception as e:  # recovery gave up: the interruptions it saw are the ledger's too
            for ev in getattr(e, "events", None) or []:
                record_interruption_task(spec.ledger.url, job.run_id, ev)
            raise
        if result.cluster is not None:  # recovery may have excluded or replaced nodes: teardown reaches them all
            rental.cluster = rental.cluster.union(result.cluster)
        for i in result.interruptions:  # the ledger keeps every interruption, as for the native backend
            ev = Event.model_validate(i.model_dump())
            record_interruption_task(spec.ledger.url, job.run_id, ev)
        span = BillingSpan(start, result.wall_s, rental.cluster.world_size)
        return TrainOutcome(
            result,
            result.cluster or rental.cluster,
            job.plan,
            [span],
            train_s=result.wall_s,
            interruptions=len(result.interruptions),
            recovery_s=sum(i.recovery_s or 0.0 for i in result.interruptions),
        )
    trained = train_with_recovery(spec, rental.provider, rental.cluster, job)
    rental.cluster = trained.cluster
    if spec.train.task == "grpo":  # the sampled completions and their rewards (train.grpo.log_completions_every)
        completions_artifact_task(job.run_dir)
    return trained


def benchmark_stage(
    spec: RunSpec, run_dir: Path, result: TrainResult, rental: Rental, watch: Stopwatch
) -> BenchReport | None:
    """lm-eval on the export and the base (validate.benchmarks) while the nodes are held, timed as its own stage;
    None when no benchmark is set. `tasks.benchmarks.with_benchmarks` joins it to the validation outcome."""
    if spec.validate_.benchmarks is None:
        return None
    with watch.stage("benchmarks"):
        return benchmark_task(spec, run_dir, result, rental.provider, rental.cluster)


def validate_stage(
    spec: RunSpec, run_dir: Path, trained: TrainOutcome, shape: ModelShape, bench: BenchReport | None, watch: Stopwatch
) -> ValidationOutcome:
    """The gates on the run's metrics (timed as the validate stage), with the benchmark stage's gates and
    figures joined (`with_benchmarks`)."""
    with watch.stage("validate"):
        outcome = validate_task(spec, run_dir, trained.plan, trained.result, shape, trained.cluster.world_size)
    return with_benchmarks(outcome, bench)


def night_stage(spec: RunSpec, run_id: str, gate: GateDecision, rental: Rental, trained: TrainOutcome) -> NightsSoFar:
    """Price this night (provisioning of the cluster first rented, then every training span at its size) and
    append it to the run's ledger row; the run's cost over all its nights and the nights left."""
    first = rental.first
    night = night_record(
        spec, gate, rental.started, first.time_to_ready_s, first.world_size, trained.spans, trained.result
    )
    return record_night_task(spec, run_id, gate, night)


def continue_in_next_window(spec: RunSpec, run_id: str) -> tuple[str, str | None]:
    """Schedule the continuation of a split run at the next window start (same run id: resumes its checkpoint)."""
    now = clock() or datetime.now(UTC)
    start = next_window(spec.schedule, now).start.astimezone(ZoneInfo(spec.schedule.timezone))
    params = {"spec": spec.model_dump(mode="json", by_alias=True), "resume_run_id": run_id}
    return start.isoformat(), schedule_same_deployment(params, start)
