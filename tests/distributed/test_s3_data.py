"""The trainer reads its shards from a real S3 server (SeaweedFS) and sees exactly the local data."""

from __future__ import annotations

import pytest

from nightloom.storage import S3Config
from tests.support.harness import launch, make_job

pytestmark = pytest.mark.services


@pytest.mark.timeout(300)
def test_training_from_s3_matches_local(s3_endpoint, corpus, reference, tmp_path):  # noqa: F811
    import boto3

    url, bucket = s3_endpoint
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    for f in sorted(corpus.iterdir()):
        client.upload_file(str(f), bucket, f"trainer-corpus/{f.name}")
    job = make_job(
        tmp_path / "s3",
        f"s3://{bucket}/trainer-corpus",
        steps=5,
        job_kw={"s3": S3Config(endpoint_url=url)},
        micro_batch=2,
        grad_accum=4,
    )
    out = launch(1, job)
    assert out.losses == reference.losses  # same bytes, same batches, same single-process arithmetic
