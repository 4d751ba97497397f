"""XTuner's base model through the same door as the native backend's: `model.weights` (+ `model.tokenizer`).

`base_source` says which folder or s3:// prefix a spec fine-tunes (`model.weights`, or the older
`train.xtuner.base_model`, which must agree with it when both are set); `check_source` proves it holds a
config, a tokenizer and weights before any node is rented. An s3:// model is fetched once per node
(`fetch_cached`, also runnable there as `python -m nightloom.finetune.base_model URI`) into
`<cache root>/<content key>`: the key hashes every object's name, size and ETag, so a changed model gets a
new folder; the download holds a file lock, each file is checked against its source (size, and MD5 = ETag
for single-part uploads), and the stamp is written last, so a second run (or a node sharing the cache)
reuses it. Nodes read S3 with their own credential chain (environment, `AWS_SHARED_CREDENTIALS_FILE`, an
instance role): no secret travels on a command line.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nightloom.finetune.config import TOKENIZER_FILES, WEIGHT_GLOBS, XTunerConfigError, check_base_model
from nightloom.util import atomic_write_text

MARK = "NIGHTLOOM_BASE_MODEL "
STAMP = ".nightloom-model.json"
#: environment the orchestrator forwards to nodes for the fetch: where the cache is, how to reach S3 (no secrets)
FORWARD_ENV = (
    "NIGHTLOOM_MODEL_CACHE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
)


@dataclass(frozen=True)
class BaseSource:
    """Where the base model comes from: a local folder or s3:// prefix, the field path that named it, and a
    separate Hugging Face tokenizer folder (`model.tokenizer.path`) or None for the model folder's own."""

    uri: str
    field: str
    tokenizer: str | None = None

    @property
    def is_s3(self) -> bool:
        return self.uri.startswith("s3://")


@dataclass(frozen=True)
class FetchedModel:
    """A base model ready on one machine: its local folder, content key, whether this call downloaded it."""

    path: str
    key: str
    created: bool
    seconds: float


def _norm(uri: str) -> str:
    return uri.rstrip("/")


def base_source(spec) -> BaseSource:
    """The spec's XTuner base model. `model.weights` names it for both backends; `train.xtuner.base_model`
    stays as an older alias (both set must agree). The tokenizer: `model.tokenizer.path` when it is set
    (a Hugging Face tokenizer folder), else the model folder's."""
    xs = spec.train.xtuner
    weights = spec.model.weights or ""
    alias = (xs.base_model if xs is not None else "") or ""
    if weights and alias and _norm(weights) != _norm(alias):
        raise XTunerConfigError(
            f"model.weights ({weights!r}) and train.xtuner.base_model ({alias!r}) name different base models; "
            "set model.weights only (train.xtuner.base_model is its older alias)"
        )
    if not weights and not alias:
        raise XTunerConfigError(
            "model.weights: required for train.backend 'xtuner' (the base model: a Hugging Face folder or "
            "s3:// prefix; train.xtuner.base_model is accepted as its older alias)"
        )
    field = "model.weights" if weights else "train.xtuner.base_model"
    tok = spec.model.tokenizer
    tokenizer = None
    if tok.path and _norm(tok.path) != _norm(weights or alias):
        if tok.kind not in ("auto", "hf") or tok.train_vocab:
            raise XTunerConfigError(
                f"model.tokenizer: XTuner loads a Hugging Face tokenizer folder (AutoTokenizer), not kind {tok.kind!r}"
                + (" with train_vocab" if tok.train_vocab else "")
            )
        tokenizer = tok.path
    return BaseSource(weights or alias, field, tokenizer)


def check_tokenizer(path: str) -> Path:
    p = Path(path)
    if not p.is_dir() or not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise XTunerConfigError(
            f"model.tokenizer.path: {path!r}: not a Hugging Face tokenizer folder ({' or '.join(TOKENIZER_FILES)})"
        )
    return p


def _listing(uri: str, s3=None) -> list[tuple[str, int, str]]:
    """(relative name, size, ETag) of every object under an s3:// prefix, sorted by name."""
    from nightloom.sharding import storage

    loc = storage.S3Location.parse(uri)
    prefix = loc.key.rstrip("/") + "/" if loc.key else ""
    out: list[tuple[str, int, str]] = []

    def run() -> None:
        for page in storage.s3_client(s3).get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if rel and not rel.endswith("/"):
                    out.append((rel, int(obj["Size"]), obj.get("ETag", "").strip('"')))

    storage._s3_call(uri, "list", run, s3)
    return sorted(out)


def _check_names(field: str, uri: str, names: list[str]) -> None:
    top = {n for n in names if "/" not in n}
    missing = []
    if "config.json" not in top:
        missing.append("config.json")
    if not any(f in top for f in TOKENIZER_FILES):
        missing.append("a tokenizer (" + " or ".join(TOKENIZER_FILES) + ")")
    if not any(Path(n).match(g) for n in top for g in WEIGHT_GLOBS):
        missing.append("weights (" + " or ".join(WEIGHT_GLOBS) + ")")
    if missing:
        what = "no objects" if not names else f"missing {', '.join(missing)}"
        raise XTunerConfigError(f"{field}: {uri}: {what}")


def content_key(listing: list[tuple[str, int, str]]) -> str:
    """The cache folder's name: a hash over every object's name, size and ETag (a changed file, a new key)."""
    h = hashlib.sha256()
    for name, size, etag in listing:
        h.update(f"{name}\t{size}\t{etag}\n".encode())
    return h.hexdigest()[:20]


def check_source(src: BaseSource, s3=None) -> None:
    """Before any node is rented: the base model (local folder or s3:// prefix) holds config.json, a
    tokenizer and weights, and a separate tokenizer folder is one; XTunerConfigError naming the field."""
    if src.tokenizer:
        check_tokenizer(src.tokenizer)
    if src.is_s3:
        from nightloom.sharding.storage import StorageError

        try:
            listing = _listing(src.uri, s3)
        except StorageError as e:
            raise XTunerConfigError(f"{src.field}: {e}") from None
        _check_names(src.field, src.uri, [n for n, _, _ in listing])
        return
    try:
        check_base_model(src.uri)
    except XTunerConfigError as e:
        raise XTunerConfigError(str(e).replace("train.xtuner.base_model", src.field, 1)) from None


def default_cache_root() -> Path:
    return Path(os.environ.get("NIGHTLOOM_MODEL_CACHE") or Path.home() / ".cache" / "nightloom" / "models")


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verify(dest: Path, listing: list[tuple[str, int, str]], uri: str) -> None:
    """Every file as its source object: the size always; the MD5 where the ETag is one (single-part upload;
    a multipart ETag `md5-of-parts-N` depends on the uploader's part size)."""
    for name, size, etag in listing:
        p = dest / name
        got = p.stat().st_size if p.is_file() else None
        if got != size:
            raise XTunerConfigError(f"{uri}/{name}: fetched {got} bytes, the object has {size}")
        if etag and "-" not in etag and _md5(p) != etag:
            raise XTunerConfigError(f"{uri}/{name}: fetched file's MD5 differs from the object's ETag {etag}")


def fetch_cached(uri: str, cache_root: Path | None = None, s3=None, log=print) -> FetchedModel:
    """The s3:// model at `uri` as a local folder `<cache_root>/<content key>`: reused when its stamp is
    there, else downloaded under a lock, checked file by file against the source, stamped last."""
    from nightloom.sharding import storage

    t0 = time.monotonic()
    root = Path(cache_root or default_cache_root())
    listing = _listing(uri, s3)
    _check_names("model.weights", uri, [n for n, _, _ in listing])
    key = content_key(listing)
    dest = root / key
    if (dest / STAMP).is_file():
        return FetchedModel(str(dest), key, False, time.monotonic() - t0)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / STAMP).is_file():  # another process (or node sharing the cache) fetched it meanwhile
            return FetchedModel(str(dest), key, False, time.monotonic() - t0)
        shutil.rmtree(dest, ignore_errors=True)  # a crashed download's leftovers
        for name, _size, _etag in listing:
            storage.get_file(storage.join(uri, name), dest / name, s3)
        _verify(dest, listing, uri)
        check_base_model(dest)
        stamp = {"uri": uri, "key": key, "files": len(listing), "bytes": sum(s for _, s, _ in listing)}
        atomic_write_text(dest / STAMP, json.dumps(stamp) + "\n")
    secs = time.monotonic() - t0
    log(f"base model {uri}: fetched {len(listing)} files into {dest} in {secs:.2f} s")
    return FetchedModel(str(dest), key, True, secs)


def node_argv(python: str, uri: str, endpoint: str | None) -> list[str]:
    """The command a node runs to fetch (or find) the base model in its cache."""
    return [python, "-m", "nightloom.finetune.base_model", uri] + (["--endpoint", endpoint] if endpoint else [])


def forward_env() -> dict[str, str]:
    """The orchestrator's cache root and S3 pointers (paths, profile, region: never keys) for the nodes."""
    return {k: os.environ[k] for k in FORWARD_ENV if os.environ.get(k)}


def main(argv: list[str] | None = None) -> int:
    """On a node: fetch or find the model, print one JSON line (MARK) with its folder."""
    ap = argparse.ArgumentParser(prog="python -m nightloom.finetune.base_model")
    ap.add_argument("uri")
    ap.add_argument("--endpoint", default=None)
    a = ap.parse_args(argv)
    from nightloom.sharding.storage import S3Config, StorageError

    try:
        got = fetch_cached(a.uri, s3=S3Config(endpoint_url=a.endpoint), log=lambda s: print(s, file=sys.stderr))
    except (XTunerConfigError, StorageError, OSError) as e:
        print(MARK + json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"[-2000:]}), flush=True)
        return 1
    info = {"ok": True, "path": got.path, "key": got.key, "created": got.created, "seconds": round(got.seconds, 3)}
    print(MARK + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
