"""`python -m nightloom.train --job job.json` (under torchrun, or alone for one process)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pydantic import ValidationError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nightloom.train", description=__doc__)
    ap.add_argument("--job", required=True, help="path to a TrainJob JSON file")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from nightloom.parallel import LayoutError
    from nightloom.train.job import TrainJob

    p = Path(args.job)
    try:
        job = TrainJob.model_validate_json(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        print(f"[nightloom.train] {p}: job file not found", file=sys.stderr)
        return 2
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        print(f"[nightloom.train] {p}: {loc}: {first['msg']}", file=sys.stderr)
        return 2
    from nightloom.train.trainer import main as train_main

    try:
        return train_main(job)
    except LayoutError as e:
        print(f"[nightloom.train] invalid layout: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
