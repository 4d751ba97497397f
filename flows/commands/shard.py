"""`nightloom shard SPEC` or `nightloom shard --input … --output … --shards N`: hash-shard a corpus.

Pure command (no Prefect): calls nightloom.sharding.shard_dataset; with `--dask ADDRESS` (or `sharding.dask` in
SPEC) it runs the `shard-dataset` Prefect flow with its scan and write tasks on that Dask cluster instead. Exit 0
balanced, 1 not balanced, failed, or SPEC does not validate, 2 usage. `--json` prints the summary (per-shard figures, imbalance, balanced, dedup_dropped, token files).
`--tokenizer` (or SPEC's model.tokenizer) sets the tokenizer whose ids go to each shard's .bin/.idx token files.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from pydantic import ValidationError

from flows.commands.common import UsageError, load_spec_file, spec_invalid, usage
from flows.commands.spec_flags import SpecFlag, add_spec_flags, layer
from nightloom.sharding import ShardingError, shard_dataset, summarize
from nightloom.spec import DatasetSpec, ShardingSpec, SpecError, StorageSpec, TokenizerSpec
from nightloom.storage import StorageError
from nightloom.tokenizer import TokenizerError, load_tokenizer

#: the flags that set one spec field each (over SPEC's value when both are given)
_FLAGS = (
    SpecFlag(
        "--input",
        "dataset",
        "path",
        DatasetSpec,
        "JSONL(.gz/.zst), Parquet, text folder, save_to_disk folder, or s3:// prefix",
    ),
    SpecFlag("--output", "sharding", "output", ShardingSpec, "output folder or s3:// prefix"),
    SpecFlag("--shards", "sharding", "num_shards", ShardingSpec, "number of shards"),
    SpecFlag("--key", "sharding", "key_field", ShardingSpec),
    SpecFlag("--text-field", "dataset", "text_field", DatasetSpec, "field holding the text (default: text)"),
    SpecFlag("--format", "dataset", "format", DatasetSpec),
    SpecFlag("--balance-by", "sharding", "balance_by", ShardingSpec),
    SpecFlag("--tolerance", "sharding", "tolerance", ShardingSpec),
    SpecFlag("--salt", "sharding", "salt", ShardingSpec),
    SpecFlag("--on-error", "sharding", "on_error", ShardingSpec),
    SpecFlag("--max-bad-fraction", "sharding", "max_bad_fraction", ShardingSpec),
    SpecFlag("--compression", "sharding", "compression", ShardingSpec),
    SpecFlag("--no-dedup", "sharding", "dedup", ShardingSpec, "keep exact duplicates"),
    SpecFlag("--s3-endpoint-url", "storage", "s3_endpoint_url", StorageSpec),  # keys: AWS_* or the secret block
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "shard",
        help="hash-shard a dataset into balanced Parquet shards + manifest.json",
        description="Shard the dataset of SPEC, or the one given by --input/--output/--shards. "
        "Flags given with SPEC override the spec. Exit 0 balanced, 1 not balanced, failed or SPEC invalid, 2 usage.",
    )
    p.add_argument("spec", nargs="?", help="run spec YAML (uses its dataset, sharding and storage sections)")
    add_spec_flags(p, _FLAGS)
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="threads for scanning and writing (default: the CPU count; the output is identical for any value)",
    )
    p.add_argument(
        "--dask",
        metavar="ADDRESS",
        help="run the scan and write tasks on a Dask cluster (scheduler address, e.g. tcp://10.0.0.2:8786) "
        "through the shard-dataset Prefect flow; the output is the same as on one machine",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer for the .bin/.idx token files and token counts: a Hugging Face folder (tokenizer.json), "
        "a tiktoken rank file, a SentencePiece .model, or `bytes` (default; overrides SPEC's model.tokenizer)",
    )
    p.add_argument(
        "--tokenizer-pattern",
        metavar="NAME_OR_REGEX",
        help="with a tiktoken rank file: its split pattern, or an encoding name such as cl100k_base",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _progress_lines():
    """Progress as plain stderr lines (readable in logs, not only on a terminal): each stage's first and last
    item and about every tenth of it, with the elapsed time; stdout stays the summary (or the --json)."""
    t0 = time.monotonic()
    seen: dict[str, int] = {}
    lock = threading.Lock()  # scan/write callbacks arrive from worker threads

    def note(stage: str, count: int, total: int) -> None:
        with lock:
            before, seen[stage] = seen.get(stage, 0), count
            tenth = max(1, total // 10)
            if before == 0 or count >= total or count // tenth > before // tenth:
                unit = "input files" if stage == "scan" else "shards"
                print(
                    f"[shard] {stage} {count}/{total} {unit}  {time.monotonic() - t0:6.1f} s",
                    file=sys.stderr,
                    flush=True,
                )

    return note


def _sections(args) -> tuple[DatasetSpec, ShardingSpec, StorageSpec]:
    """Spec sections from SPEC (if given) with the flags layered on top; raises SpecError (the spec does not
    validate), UsageError (a required flag missing) or ValidationError (a flag's value is wrong)."""
    if args.spec:
        spec = load_spec_file(args.spec)
        data = {k: getattr(spec, k).model_dump() for k in ("dataset", "sharding", "storage")}
    else:
        missing = [f"--{f}" for f in ("input", "output", "shards") if getattr(args, f) is None]
        if missing:
            raise UsageError(f"without SPEC, {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
        data = {"dataset": {}, "sharding": {}, "storage": {}}
    layer(args, _FLAGS, data)
    if args.dask:
        data["sharding"]["dask"] = {"address": args.dask}
    return DatasetSpec(**data["dataset"]), ShardingSpec(**data["sharding"]), StorageSpec(**data["storage"])


def _shard_on_dask(dataset: DatasetSpec, sharding: ShardingSpec, storage: StorageSpec, tokenizer):
    """The shard-dataset flow (a Prefect flow run) with its tasks on `sharding.dask`."""
    from flows.shard import shard_dataset_flow
    from nightloom.spec import ModelSpec, RunSpec

    # sharding only counts tokens: the model's vocab is the tokenizer's (the spec check must not refuse it)
    model = ModelSpec(tokenizer=tokenizer, vocab="tokenizer") if tokenizer is not None else ModelSpec()
    spec = RunSpec(name="shard", model=model, dataset=dataset, sharding=sharding, storage=storage)
    return shard_dataset_flow(spec)


def _tokenizer(args) -> TokenizerSpec | None:
    """--tokenizer/--tokenizer-pattern over SPEC's model.tokenizer, loaded once here so that a bad path or file
    is a usage error before any input is read (a `train_vocab` tokenizer is trained by the shard stage)."""
    spec = load_spec_file(args.spec).model.tokenizer if args.spec else None
    if args.tokenizer is not None:
        spec = TokenizerSpec.coerce(args.tokenizer)
    if args.tokenizer_pattern is not None:
        if spec is None or spec.is_bytes:
            raise TokenizerError("--tokenizer-pattern: needs --tokenizer PATH (a tiktoken rank file)")
        spec = spec.model_copy(update={"pattern": args.tokenizer_pattern})
    if spec is not None and spec.train_vocab is None:
        load_tokenizer(spec)
    return spec


def run(args: argparse.Namespace) -> int:
    try:
        dataset, sharding, storage = _sections(args)
    except SpecError as err:
        return spec_invalid(err)
    except UsageError as err:
        return usage("shard", str(err))
    except ValidationError as err:
        return usage("shard", "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()))
    if args.workers is not None and args.workers < 1:
        return usage("shard", "--workers must be >= 1")
    try:
        tokenizer = _tokenizer(args)
    except TokenizerError as err:
        return usage("shard", str(err))
    except ValidationError as err:
        return usage("shard", "; ".join(f"--tokenizer: {e['msg']}" for e in err.errors()))
    try:
        if sharding.dask is not None:
            manifest = _shard_on_dask(dataset, sharding, storage, tokenizer)
        else:
            if storage is not None and storage.credentials_secret:
                import tasks.shard  # noqa: F401 - registers the Prefect Secret resolver for S3 keys

            manifest = shard_dataset(
                dataset, sharding, storage, workers=args.workers, progress=_progress_lines(), tokenizer=tokenizer
            )
    except (ShardingError, StorageError, OSError) as err:
        if args.json:
            print(json.dumps({"output": sharding.output, "balanced": False, "error": str(err)}, indent=2))
        print(f"nightloom shard: failed: {err}", file=sys.stderr)
        return 1
    summary = summarize(manifest, sharding.output)
    if args.json:
        print(summary.model_dump_json(indent=2))
    else:
        print(f"{summary.num_shards} shards at {summary.output}")
        print(f"{'shard':>6} {'rows':>10} {'tokens':>14} {'bytes':>14}")
        for s in summary.shards:
            print(f"{s.index:>6} {s.rows:>10,} {s.tokens:>14,} {s.bytes:>14,}")
        print(
            f"imbalance {summary.imbalance:.4f} on {summary.balance_by} (tolerance {summary.tolerance:g}; "
            f"plain hashing {summary.imbalance_before_rebalance:.4f}{', rebalanced' if summary.rebalanced else ''}); "
            f"{summary.dedup_dropped} duplicates dropped, {summary.empty_skipped} empty, {summary.bad_records} bad"
        )
        print(summary.files_line())
        print(summary.tokens_line())
        if summary.quality is not None:  # sharding.filters / near_dup: per filter, documents and tokens removed
            print(summary.quality_line())
        print("balanced" if summary.balanced else "NOT balanced")
    return 0 if summary.balanced else 1
