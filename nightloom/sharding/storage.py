"""Local folders and s3:// prefixes behind one small interface (read, write atomically, upload, list, delete).

S3 goes through boto3 with an optional endpoint (SeaweedFS, MinIO...) and path-style addressing; credentials
come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or boto3's usual chain, and are never
put in messages. Large files are uploaded with multipart uploads; an S3 object only appears once complete,
and a local file only appears through os.replace, so no reader sees a partial file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from nightloom.sharding.errors import StorageError
from nightloom.util import atomic_write_bytes

MULTIPART_CHUNK = 8 * 1024 * 1024
_ENDPOINT_ENV = ("NIGHTLOOM_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")


def is_s3(uri: str | Path) -> bool:
    return str(uri).startswith("s3://")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        rest = uri[len("s3://") :]
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise StorageError(f"{uri}: not an s3://bucket/prefix address")
        return cls(bucket, key)


@dataclass(frozen=True)
class S3Config:
    """Where the S3 API lives; None endpoint = AWS (or the env variables above)."""

    endpoint_url: str | None = None
    region: str = "us-east-1"


_config = S3Config()


def configure_s3(endpoint_url: str | None = None, region: str | None = None) -> None:
    """Set the endpoint used by later calls (from StorageSpec.s3_endpoint_url / s3_region)."""
    global _config
    _config = S3Config(endpoint_url or None, region or "us-east-1")


def _endpoint() -> str | None:
    if _config.endpoint_url:
        return _config.endpoint_url
    return next((os.environ[v] for v in _ENDPOINT_ENV if os.environ.get(v)), None)


@lru_cache(maxsize=8)
def _client(endpoint: str | None, region: str, identity: str):
    import boto3
    from botocore.config import Config

    cfg = Config(
        s3={"addressing_style": "path"},
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=region, config=cfg)


def s3_client():
    """A cached boto3 S3 client for the configured endpoint (re-created when the credentials change)."""
    ident = f"{os.environ.get('AWS_ACCESS_KEY_ID')}|{os.environ.get('AWS_SECRET_ACCESS_KEY')}"
    return _client(_endpoint(), _config.region, hashlib.sha256(ident.encode()).hexdigest())


def _explain(err: Exception, uri: str, action: str) -> StorageError:
    """Translate a boto3/botocore error into a message with the place and the cause, never the secret."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    where = f"{uri} (endpoint {_endpoint() or 'AWS default'})"
    if isinstance(err, EndpointConnectionError):
        return StorageError(f"{action} {where}: cannot reach the S3 endpoint: is it running and the URL right?")
    if isinstance(err, NoCredentialsError):
        return StorageError(f"{action} {where}: no S3 credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "?")
        if code in ("NoSuchBucket",):
            return StorageError(f"{action} {where}: bucket {S3Location.parse(uri).bucket!r} does not exist")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden"):
            return StorageError(
                f"{action} {where}: S3 refused the credentials ({code}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            )
        if code in ("NoSuchKey", "404", "NotFound"):
            return StorageError(f"{action} {where}: no such object")
        return StorageError(f"{action} {where}: S3 error {code}")
    return StorageError(f"{action} {where}: {type(err).__name__}: {err}")


def _s3_call(uri: str, action: str, fn):
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn()
    except (BotoCoreError, ClientError) as err:
        raise _explain(err, uri, action) from None


def join(base: str, name: str) -> str:
    """`base/name` for a folder path or an s3:// prefix."""
    return str(base).rstrip("/") + "/" + name


def read_bytes(uri: str | Path) -> bytes:
    """Whole content of a local file or an S3 object (for small files: manifests, markers)."""
    uri = str(uri)
    if not is_s3(uri):
        return Path(uri).read_bytes()
    loc = S3Location.parse(uri)
    body = _s3_call(uri, "read", lambda: s3_client().get_object(Bucket=loc.bucket, Key=loc.key)["Body"])
    return _s3_call(uri, "read", body.read)


def exists(uri: str | Path) -> bool:
    uri = str(uri)
    if not is_s3(uri):
        return Path(uri).exists()
    from botocore.exceptions import BotoCoreError, ClientError

    loc = S3Location.parse(uri)
    try:
        s3_client().head_object(Bucket=loc.bucket, Key=loc.key)
        return True
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise _explain(err, uri, "check") from None
    except BotoCoreError as err:  # endpoint down, no credentials
        raise _explain(err, uri, "check") from None


def check_bucket(uri: str) -> None:
    """Fail early and clearly when the bucket of `uri` is missing or the credentials are refused.

    (Some S3-compatible stores create a bucket on the first PUT; a typo must not silently do that.)
    """
    from botocore.exceptions import BotoCoreError, ClientError

    loc = S3Location.parse(uri)
    try:
        s3_client().head_bucket(Bucket=loc.bucket)
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "?")
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise StorageError(
                f"{uri} (endpoint {_endpoint() or 'AWS default'}): bucket {loc.bucket!r} does not exist"
            ) from None
        if code in ("403", "Forbidden"):
            raise StorageError(
                f"{uri} (endpoint {_endpoint() or 'AWS default'}): S3 refused the credentials for bucket "
                f"{loc.bucket!r} (403); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            ) from None
        raise _explain(err, uri, "open bucket") from None
    except BotoCoreError as err:
        raise _explain(err, uri, "open bucket") from None


def head(uri: str) -> tuple[int, str]:
    """(size, ETag without quotes) of an S3 object."""
    loc = S3Location.parse(uri)
    h = _s3_call(uri, "stat", lambda: s3_client().head_object(Bucket=loc.bucket, Key=loc.key))
    return int(h["ContentLength"]), h["ETag"].strip('"')


def write_bytes(uri: str | Path, data: bytes) -> None:
    """Write a small file atomically: temp + os.replace locally, a single PUT on S3."""
    uri = str(uri)
    if is_s3(uri):
        loc = S3Location.parse(uri)
        _s3_call(uri, "write", lambda: s3_client().put_object(Bucket=loc.bucket, Key=loc.key, Body=data))
        return
    atomic_write_bytes(uri, data)


def put_file(local: Path, uri: str) -> None:
    """Publish a finished local file at `uri`: os.replace locally, multipart upload (8 MiB parts) on S3."""
    if not is_s3(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        os.replace(local, uri)
        return
    from boto3.s3.transfer import TransferConfig

    loc = S3Location.parse(uri)
    cfg = TransferConfig(multipart_threshold=MULTIPART_CHUNK, multipart_chunksize=MULTIPART_CHUNK, max_concurrency=4)
    _s3_call(uri, "upload", lambda: s3_client().upload_file(str(local), loc.bucket, loc.key, Config=cfg))


def get_file(uri: str, local: Path) -> Path:
    """Download an S3 object to `local` (streamed to disk, atomically)."""
    from boto3.s3.transfer import TransferConfig

    loc = S3Location.parse(uri)
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.part")
    cfg = TransferConfig(multipart_threshold=MULTIPART_CHUNK, multipart_chunksize=MULTIPART_CHUNK, max_concurrency=4)
    _s3_call(uri, "download", lambda: s3_client().download_file(loc.bucket, loc.key, str(tmp), Config=cfg))
    os.replace(tmp, local)
    return local


def list_files(uri: str) -> list[tuple[str, int]]:
    """(relative name, size) of every object/file under a folder or prefix, sorted by name."""
    if not is_s3(uri):
        root = Path(uri)
        return sorted((p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*") if p.is_file())
    loc = S3Location.parse(uri)
    prefix = loc.key.rstrip("/") + "/" if loc.key else ""
    out: list[tuple[str, int]] = []

    def run() -> None:
        pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                out.append((obj["Key"][len(prefix) :], int(obj["Size"])))

    _s3_call(uri, "list", run)
    return sorted(out)


def delete(uri: str) -> None:
    if not is_s3(uri):
        Path(uri).unlink(missing_ok=True)
        return
    loc = S3Location.parse(uri)
    _s3_call(uri, "delete", lambda: s3_client().delete_object(Bucket=loc.bucket, Key=loc.key))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def xxh3_file(path: Path, chunk: int = 1 << 22) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()
