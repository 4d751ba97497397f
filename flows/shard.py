"""The `shard-dataset` flow: hash-shard the spec's dataset; runs as the pipeline's first sub-flow or alone.

Inputs are scanned by one task each and shards written by one task each, so a distributed task runner
(prefect-dask's DaskTaskRunner, prefect-ray's RayTaskRunner) spreads them across machines when the work
folder (`sharding.output` for local outputs) is on storage every worker sees.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, unmapped

from nightloom.sharding import ShardingError, ShardManifest
from nightloom.sharding.pipeline import shard_indices
from nightloom.spec import RunSpec, coerce_spec
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


@flow(name="shard-dataset", validate_parameters=True)
def shard_dataset_flow(spec: RunSpec | str) -> ShardManifest:
    """Shard `spec.dataset` per `spec.sharding`; returns the manifest (reused when nothing changed)."""
    run_spec = coerce_spec(spec)
    log = get_run_logger()
    output = run_spec.sharding.output
    try:
        job = plan_shards_task(run_spec.dataset, run_spec.sharding, run_spec.storage, run_spec.model.tokenizer)
        done = reuse_manifest_task(job)
        if done is not None:
            log.info("inputs and settings unchanged (hash %s): reusing %s", job.settings_hash, output)
            report_shards(done, output, reused=True)
            return done
        scans = [f.result() for f in scan_input_task.map(unmapped(job), range(len(job.sources)))]
        placement = place_documents_task(job, scans)
        infos = [f.result() for f in write_shard_task.map(unmapped(job), unmapped(scans), shard_indices(job))]
        manifest = publish_manifest_task(job, scans, placement, infos)
    except ShardingError as err:
        report_failure(str(err))
        raise
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
