"""`python -m nightloom.train --job job.json` (under torchrun, or alone for one process)."""

from __future__ import annotations

import argparse
import logging
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


def exit_now(rc: int) -> None:
    """Leave without the interpreter's teardown once everything is written and closed: under torchrun a rank's
    native teardown (process-group and store destructors) took ~4 s after a 2-node run, billed time on every
    node, against <1 s for os._exit. Only after a normal return: an exception still goes through torchrun's
    error reporting."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker; a plain process exits as usual
        exit_now(code)
    sys.exit(code)
