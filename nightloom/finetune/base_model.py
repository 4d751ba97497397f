"""XTuner's base model through the same door as the native backend's: `model.weights` (+ `model.tokenizer`).

`base_source` says which folder or s3:// prefix a spec fine-tunes (`model.weights`, or the older
`train.xtuner.base_model`, which must agree with it when both are set); `check_source` proves it holds a
config, a tokenizer and weights before any node is rented. An s3:// model is fetched once per node
(`fetch_cached`, also runnable there as `python -m nightloom.finetune.base_model URI`) into the machine's
model cache (nightloom.model_cache: content-keyed, locked, checked file by file, stamped last), the same
folder the native trainer uses for that model. Nodes read S3 with their own credential chain (environment, `AWS_SHARED_CREDENTIALS_FILE`, an
instance role): no secret travels on a command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from nightloom.finetune.config import TOKENIZER_FILES, WEIGHT_GLOBS, XTunerConfigError, check_base_model
from nightloom.model_cache import FetchedModel, ModelFetchError, fetch_model
from nightloom.node_reply import reply, reply_error

MARK = "NIGHTLOOM_BASE_MODEL "
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


def check_source(src: BaseSource, s3=None) -> None:
    """Before any node is rented: the base model (local folder or s3:// prefix) holds config.json, a
    tokenizer and weights, and a separate tokenizer folder is one; XTunerConfigError naming the field."""
    if src.tokenizer:
        check_tokenizer(src.tokenizer)
    if src.is_s3:
        from nightloom import storage

        try:
            names = [o.name for o in storage.list_objects(src.uri, s3)]
        except storage.StorageError as e:
            raise XTunerConfigError(f"{src.field}: {e}") from None
        _check_names(src.field, src.uri, names)
        return
    try:
        check_base_model(src.uri)
    except XTunerConfigError as e:
        raise XTunerConfigError(str(e).replace("train.xtuner.base_model", src.field, 1)) from None


def fetch_cached(uri: str, cache_root: Path | None = None, s3=None, log=print) -> FetchedModel:
    """The s3:// base model at `uri` in this machine's model cache (nightloom.model_cache, shared with the
    native trainer), checked to hold config.json, a tokenizer and weights before download and after."""
    try:
        return fetch_model(
            uri,
            cache_root,
            s3,
            check_names=lambda names: _check_names("model.weights", uri, names),
            check_folder=check_base_model,
            log=log,
        )
    except ModelFetchError as e:
        raise XTunerConfigError(str(e)) from None


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
    from nightloom.storage import S3Config, StorageError

    try:
        got = fetch_cached(a.uri, s3=S3Config(endpoint_url=a.endpoint), log=lambda s: print(s, file=sys.stderr))
    except (XTunerConfigError, StorageError, OSError) as e:
        return reply_error(MARK, e)
    reply(MARK, {"path": got.path, **got.reply_fields()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
