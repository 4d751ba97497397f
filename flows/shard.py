"""The `shard-dataset` flow: hash-shard the spec's dataset; runs as the pipeline's first sub-flow or alone.

Inputs are scanned by one task per scan unit (a file, or many small files together) and shards written by one
task each. With `sharding.dask` set, those tasks run on a Dask cluster (prefect-dask's DaskTaskRunner) in a
`shard-on-dask` sub-flow; every worker must import this project and reach the inputs, the output and the work
folder. With an s3:// output the work folder is `<output>/.nightloom-work/<hash>` on S3 (or
`$NIGHTLOOM_SHARD_WORKDIR`), so workers on other machines need nothing shared but S3; with a local output it is
`<output>/.nightloom-work`, which the workers must share.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, unmapped
from prefect.context import FlowRunContext

from flows.ui_schema import RunSpecForm
from nightloom.chat import ChatError, chat_settings
from nightloom.sharding import ShardingError, ShardJob, ShardManifest, readahead
from nightloom.sharding.pipeline import shard_indices
from nightloom.sharding.workdir import WorkDir
from nightloom.spec import DaskSpec
from nightloom.spec.load import coerce_spec
from nightloom.storage import StorageError
from nightloom.tokenizer import prepare_chat_tokenizer
from tasks.shard import (
    place_documents_task,
    plan_shards_task,
    publish_manifest_task,
    report_failure,
    report_shards,
    reuse_manifest_task,
    scan_input_task,
    write_shard_task,
)


def dask_runner(dask: DaskSpec):
    """The DaskTaskRunner for `sharding.dask`: a running scheduler's address, or a cluster class to start."""
    from prefect_dask import DaskTaskRunner

    if dask.address:
        return DaskTaskRunner(address=dask.address)
    return DaskTaskRunner(cluster_class=dask.cluster_class, cluster_kwargs=dict(dask.cluster_kwargs))


def shard_job(job: ShardJob) -> ShardManifest:
    """Scan every unit, place, write every shard, publish: the map steps, on the current flow's task runner."""
    scans = [f.result() for f in scan_input_task.map(unmapped(job), range(len(job.units)))]
    placement = place_documents_task(job, scans)
    infos = [f.result() for f in write_shard_task.map(unmapped(job), unmapped(scans), shard_indices(job))]
    return publish_manifest_task(job, scans, placement, infos)


def _drop_cache(workdir: str) -> None:
    """Runs on each Dask worker: its cached copies of an S3 work folder's files (a module function, so workers
    unpickle it by name)."""
    WorkDir(workdir).drop_cache()


@flow(name="shard-on-dask")
def shard_on_dask_flow(job: ShardJob) -> ShardManifest:
    """`shard_job` in a sub-flow whose task runner is the Dask cluster (set with `with_options`); place and
    publish (the small reduce steps) run in the flow's process. Then every worker drops its cached work files."""
    manifest = shard_job(job)
    if job.work.remote:
        try:
            FlowRunContext.get().task_runner.client.run(_drop_cache, job.workdir)
        except Exception as err:  # noqa: BLE001 - the shards are published; a leftover cache is only disk space
            get_run_logger().warning("could not clear the workers' work caches: %s", err)
    return manifest


@flow(name="shard-dataset", validate_parameters=True)
def shard_dataset_flow(spec: RunSpecForm | str) -> ShardManifest:
    """Shard `spec.dataset` per `spec.sharding`; returns the manifest (reused when nothing changed).

    Args:
        spec: The run spec: the form (RunSpec), or the path of a spec YAML file from the repository root.
    """
    run_spec = coerce_spec(spec)
    log = get_run_logger()
    output, dask = run_spec.sharding.output, run_spec.sharding.dask
    try:
        if prepare_chat_tokenizer(run_spec):  # sft with train_vocab: a BPE with ChatML, before its template is read
            log.info("trained a ChatML BPE tokenizer at %s", run_spec.model.tokenizer.path)
        chat = chat_settings(run_spec)  # train.task sft: chat records, their template and seq_len
        job = plan_shards_task(run_spec.dataset, run_spec.sharding, run_spec.storage, run_spec.model.tokenizer, chat)
        done = reuse_manifest_task(job)
        if done is not None:
            log.info("inputs and settings unchanged (hash %s): reusing %s", job.settings_hash, output)
            report_shards(done, output, reused=True)
            return done
        if dask is None:
            manifest = shard_job(job)
        else:
            log.info("scan and write tasks on Dask (%s)", dask.address or dask.cluster_class)
            manifest = shard_on_dask_flow.with_options(task_runner=dask_runner(dask))(job)
    except (ShardingError, StorageError, ChatError) as err:
        report_failure(str(err))
        raise
    finally:
        readahead.clear()  # small files' bytes the plan kept for scans in this process and no scan took
    log.info(
        "%d shards, imbalance %.4f on %s (before rebalancing %.4f), %d duplicates dropped",
        manifest.num_shards,
        manifest.imbalance,
        manifest.balance_by,
        manifest.imbalance_before_rebalance,
        manifest.dedup_dropped,
    )
    report_shards(manifest, output, reused=False)
    return manifest
