"""The object store: local folders and s3:// prefixes behind one small interface (read, write atomically, upload,
list, delete). Sharding (inputs, work files, shards) and runs (trainer data, Hugging Face weights, the model cache,
fine-tuning inputs) reach their files through it.

S3 goes through boto3 with an optional endpoint (SeaweedFS, MinIO...) and path-style addressing. Where the
S3 API lives is an `S3Config` that callers pass explicitly (it travels inside ShardJob/TrainJob to whichever
process opens files, Dask workers included); credentials are never in it: they come from the environment
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, boto3's usual chain) or from a named secret that the orchestration
layer resolves (`set_secret_resolver`), and are never put in messages. Large files are uploaded with multipart
uploads; an S3 object only appears once complete, and a local file only appears through os.replace, so no reader
sees a partial file.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from nightloom.records import FrozenRecord
from nightloom.util import atomic_write_bytes


class StorageError(RuntimeError):
    """An object store or folder cannot be reached or used (endpoint, bucket, credentials); never shows secrets."""


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


class S3Config(FrozenRecord):
    """Where the S3 API lives (no secrets: safe to log, pickle and send as a task parameter).

    `endpoint_url` None = the first of the endpoint environment variables above, else AWS. `credentials_secret`
    names a secret holding 'KEY_ID:SECRET' (a Prefect Secret block, read by the process that opens files through
    the resolver the orchestration layer registers); None = the environment / boto3's chain."""

    endpoint_url: str | None = None
    region: str = "us-east-1"
    credentials_secret: str | None = None

    @classmethod
    def from_spec(cls, spec) -> S3Config:
        """From a StorageSpec (s3_endpoint_url, s3_region, credentials_secret); None = the defaults."""
        if spec is None:
            return cls()
        return cls(
            endpoint_url=(spec.s3_endpoint_url or "").strip() or None,
            region=spec.s3_region or "us-east-1",
            credentials_secret=spec.credentials_secret,
        )

    def endpoint(self) -> str | None:
        if self.endpoint_url:
            return self.endpoint_url
        return next((os.environ[v] for v in _ENDPOINT_ENV if os.environ.get(v)), None)


DEFAULT_S3 = S3Config()
SecretResolver = Callable[[str], tuple[str, str]]  # secret name -> (access key id, secret access key)
_resolver: SecretResolver | None = None
_resolver_lock = threading.Lock()


def set_secret_resolver(resolver: SecretResolver | None) -> None:
    """Register how a process turns `S3Config.credentials_secret` into keys (tasks/ registers Prefect's Secret
    blocks on import, so every process that runs a task, Dask workers included, can resolve them)."""
    global _resolver
    with _resolver_lock:
        _resolver = resolver


@lru_cache(maxsize=8)
def _secret(name: str) -> tuple[str, str]:
    if _resolver is None:
        raise StorageError(f"storage.credentials_secret {name!r}: no secret resolver in this process")
    try:
        return _resolver(name)
    except StorageError:
        raise
    except Exception as err:  # noqa: BLE001 - the resolver's own error, without the secret
        raise StorageError(f"storage.credentials_secret {name!r}: cannot read it ({type(err).__name__})") from None


@lru_cache(maxsize=8)
def _client(endpoint: str | None, region: str, identity: str, secret: str | None):
    import boto3
    from botocore.config import Config

    cfg = Config(
        s3={"addressing_style": "path"},
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
    )
    keys = {}
    if secret is not None:
        key_id, key = _secret(secret)
        keys = {"aws_access_key_id": key_id, "aws_secret_access_key": key}
    session = boto3.session.Session(**keys)
    return session.client("s3", endpoint_url=endpoint, region_name=region, config=cfg)


def s3_client(cfg: S3Config | None = None):
    """A cached boto3 S3 client for `cfg` (re-created when the environment's credentials change)."""
    cfg = cfg or DEFAULT_S3
    ident = f"{os.environ.get('AWS_ACCESS_KEY_ID')}|{os.environ.get('AWS_SECRET_ACCESS_KEY')}"
    return _client(cfg.endpoint(), cfg.region, hashlib.sha256(ident.encode()).hexdigest(), cfg.credentials_secret)


def _explain(err: Exception, uri: str, action: str, cfg: S3Config | None = None) -> StorageError:
    """Translate a boto3/botocore error into a message with the place and the cause, never the secret."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    where = f"{uri} (endpoint {(cfg or DEFAULT_S3).endpoint() or 'AWS default'})"
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


def _s3_call(uri: str, action: str, fn, cfg: S3Config | None = None):
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn()
    except (BotoCoreError, ClientError) as err:
        raise _explain(err, uri, action, cfg) from None


def join(base: str, name: str) -> str:
    """`base/name` for a folder path or an s3:// prefix."""
    return str(base).rstrip("/") + "/" + name


def read_bytes(uri: str | Path, s3: S3Config | None = None) -> bytes:
    """Whole content of a local file or an S3 object (for small files: manifests, markers)."""
    uri = str(uri)
    if not is_s3(uri):
        return Path(uri).read_bytes()
    loc = S3Location.parse(uri)
    client = s3_client(s3)
    body = _s3_call(uri, "read", lambda: client.get_object(Bucket=loc.bucket, Key=loc.key)["Body"], s3)
    return _s3_call(uri, "read", body.read, s3)


def read_if_exists(uri: str | Path, s3: S3Config | None = None) -> bytes | None:
    """`read_bytes`, or None when there is no such file/object (one request on S3: for markers)."""
    uri = str(uri)
    if not is_s3(uri):
        try:
            return Path(uri).read_bytes()
        except FileNotFoundError:
            return None
    from botocore.exceptions import BotoCoreError, ClientError

    loc = S3Location.parse(uri)
    try:
        return s3_client(s3).get_object(Bucket=loc.bucket, Key=loc.key)["Body"].read()
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise _explain(err, uri, "read", s3) from None
    except BotoCoreError as err:
        raise _explain(err, uri, "read", s3) from None


def exists(uri: str | Path, s3: S3Config | None = None) -> bool:
    uri = str(uri)
    if not is_s3(uri):
        return Path(uri).exists()
    from botocore.exceptions import BotoCoreError, ClientError

    loc = S3Location.parse(uri)
    try:
        s3_client(s3).head_object(Bucket=loc.bucket, Key=loc.key)
        return True
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise _explain(err, uri, "check", s3) from None
    except BotoCoreError as err:  # endpoint down, no credentials
        raise _explain(err, uri, "check", s3) from None


def check_bucket(uri: str, s3: S3Config | None = None) -> None:
    """Fail early and clearly when the bucket of `uri` is missing or the credentials are refused.

    (Some S3-compatible stores create a bucket on the first PUT; a typo must not silently do that.)
    """
    from botocore.exceptions import BotoCoreError, ClientError

    loc = S3Location.parse(uri)
    where = f"{uri} (endpoint {(s3 or DEFAULT_S3).endpoint() or 'AWS default'})"
    try:
        s3_client(s3).head_bucket(Bucket=loc.bucket)
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "?")
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise StorageError(f"{where}: bucket {loc.bucket!r} does not exist") from None
        if code in ("403", "Forbidden"):
            raise StorageError(
                f"{where}: S3 refused the credentials for bucket "
                f"{loc.bucket!r} (403); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            ) from None
        raise _explain(err, uri, "open bucket", s3) from None
    except BotoCoreError as err:
        raise _explain(err, uri, "open bucket", s3) from None


def head(uri: str, s3: S3Config | None = None) -> tuple[int, str]:
    """(size, ETag without quotes) of an S3 object."""
    loc = S3Location.parse(uri)
    h = _s3_call(uri, "stat", lambda: s3_client(s3).head_object(Bucket=loc.bucket, Key=loc.key), s3)
    return int(h["ContentLength"]), h["ETag"].strip('"')


def write_bytes(uri: str | Path, data: bytes, s3: S3Config | None = None) -> None:
    """Write a small file atomically: temp + os.replace locally, a single PUT on S3."""
    uri = str(uri)
    if is_s3(uri):
        loc = S3Location.parse(uri)
        _s3_call(uri, "write", lambda: s3_client(s3).put_object(Bucket=loc.bucket, Key=loc.key, Body=data), s3)
        return
    atomic_write_bytes(uri, data)


def _transfer():
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_CHUNK, multipart_chunksize=MULTIPART_CHUNK, max_concurrency=4)


def put_file(local: Path, uri: str, s3: S3Config | None = None) -> None:
    """Publish a finished local file at `uri`: os.replace locally, multipart upload (8 MiB parts) on S3."""
    if not is_s3(uri):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        os.replace(local, uri)
        return
    upload_file(local, uri, s3)


def upload_file(local: Path, uri: str, s3: S3Config | None = None) -> None:
    """Upload a local file to an S3 object (the local file stays); the object appears only once complete."""
    loc = S3Location.parse(uri)
    client = s3_client(s3)
    _s3_call(uri, "upload", lambda: client.upload_file(str(local), loc.bucket, loc.key, Config=_transfer()), s3)


def get_file(uri: str, local: Path, s3: S3Config | None = None) -> Path:
    """Download an S3 object to `local` (streamed to a temp name unique to this thread, then renamed: threads
    and processes fetching the same object never see each other's partial file)."""
    loc = S3Location.parse(uri)
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.{os.getpid()}-{threading.get_ident()}.part")
    client = s3_client(s3)
    try:
        _s3_call(uri, "download", lambda: client.download_file(loc.bucket, loc.key, str(tmp), Config=_transfer()), s3)
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)
    return local


class RangeReader(io.RawIOBase):
    """An S3 object as a seekable, read-only file where every read is one ranged GET: a shard writer opens a
    spill through it (pa.PythonFile) and fetches the IPC footer and its own record batches, not the spill whole
    (with N shards each writer would otherwise download every unit's spill: N times the corpus in all).
    `fetched` counts the bytes this reader got (`RangeReader.total` over all of this process's readers)."""

    total = 0
    _lock = threading.Lock()

    def __init__(self, uri: str, s3: S3Config | None = None):
        super().__init__()
        self.uri, self.s3, self.loc = uri, s3, S3Location.parse(uri)
        self._size: int | None = None  # a HEAD, only when a seek from the end needs it: a read needs none
        self.pos = self.fetched = 0

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = head(self.uri, self.s3)[0]
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read_at(self, offset: int, n: int) -> bytes:
        """`n` bytes from `offset` (fewer at the end of the object), in one GET and no HEAD: S3 sends what the range
        holds (a writer reads a few ranges of each of thousands of work files; a HEAD each doubled its requests)."""
        if self._size is not None:
            n = min(n, self._size - offset)
        if n <= 0:
            return b""
        from botocore.exceptions import ClientError

        rng = f"bytes={offset}-{offset + n - 1}"
        client = s3_client(self.s3)

        def get() -> bytes:
            try:
                return client.get_object(Bucket=self.loc.bucket, Key=self.loc.key, Range=rng)["Body"].read()
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") == "InvalidRange":  # starts past the end
                    return b""
                raise

        body = _s3_call(self.uri, "read", get, self.s3)
        self.fetched += len(body)
        with RangeReader._lock:
            RangeReader.total += len(body)
        return body

    def readinto(self, buf) -> int:
        data = self.read_at(self.pos, len(buf))
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass(frozen=True)
class S3Object:
    """One object under a prefix: its name relative to the prefix, size and ETag (quotes stripped)."""

    name: str
    size: int
    etag: str


def list_objects(uri: str, s3: S3Config | None = None, markers: bool = False) -> list[S3Object]:
    """Every object under an s3:// prefix, sorted by name; folder markers (`dir/`) only with `markers`."""
    loc = S3Location.parse(uri)
    prefix = loc.key.rstrip("/") + "/" if loc.key else ""
    out: list[S3Object] = []

    def run() -> None:
        pages = s3_client(s3).get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if markers or (rel and not rel.endswith("/")):
                    out.append(S3Object(rel, int(obj["Size"]), obj.get("ETag", "").strip('"')))

    _s3_call(uri, "list", run, s3)
    return sorted(out, key=lambda o: o.name)


def list_files(uri: str, s3: S3Config | None = None) -> list[tuple[str, int]]:
    """(relative name, size) of every object/file under a folder or prefix, sorted by name."""
    if not is_s3(uri):
        return [(name, st.st_size) for name, st in walk_local(str(uri))]
    return [(o.name, o.size) for o in list_objects(uri, s3, markers=True)]


def walk_local(folder: str) -> list[tuple[str, os.stat_result]]:
    """(relative name, stat) of every file under a local folder, sorted by name: the one stat each file gets
    while a dataset is planned (its size, and the key the fingerprint cache trusts)."""
    return sorted(_walk_local(folder, ""), key=lambda e: e[0])


def _walk_local(folder: str, rel: str) -> list[tuple[str, os.stat_result]]:
    """os.scandir, recursively: one stat per entry, no pathlib objects (a folder of 13k small files is listed in
    milliseconds). Symlinks are followed, as Path.rglob's is_file did."""
    out: list[tuple[str, os.stat_result]] = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for e in entries:
        name = rel + e.name
        if e.is_dir():
            out += _walk_local(e.path, name + "/")
        elif e.is_file():
            out.append((name, e.stat()))
    return out


def delete(uri: str, s3: S3Config | None = None) -> None:
    if not is_s3(uri):
        Path(uri).unlink(missing_ok=True)
        return
    loc = S3Location.parse(uri)
    _s3_call(uri, "delete", lambda: s3_client(s3).delete_object(Bucket=loc.bucket, Key=loc.key), s3)


def delete_tree(uri: str, s3: S3Config | None = None) -> None:
    """Remove a folder or every object under an S3 prefix (missing is fine)."""
    if not is_s3(uri):
        import shutil

        shutil.rmtree(uri, ignore_errors=True)
        return
    loc = S3Location.parse(uri)
    names = [join(uri, rel) for rel, _ in list_files(uri, s3)]
    client = s3_client(s3)
    for i in range(0, len(names), 1000):  # DeleteObjects takes at most 1000 keys
        keys = [{"Key": S3Location.parse(n).key} for n in names[i : i + 1000]]
        _s3_call(uri, "delete", lambda k=keys: client.delete_objects(Bucket=loc.bucket, Delete={"Objects": k}), s3)


def read_whole(path: Path | str, size: int | None = None) -> bytes:
    """A (small) local file's bytes with plain os calls: one read of its size (+1, to see it grew), no file object.
    `size`: what a listing just said (saves the fstat); the bytes returned are the file's whatever its size now."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if size is None:
            size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)
        if len(data) > size:  # it grew since it was sized: read on to the end
            parts = [data]
            while b := os.read(fd, 1 << 20):
                parts.append(b)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)
