"""Chaos benchmark: N failures injected at seeded random steps of a local run; time to recover and overhead.

Two runs of the whole pipeline flow on the local provider (2 nodes × 2 ranks, one spare node):
1. uninterrupted (the baseline);
2. the same spec with N faults: the first makes node local-1 unhealthy and kills one of its ranks (recovery
   replaces it with the spare local-2, same layout), the others kill a random rank (transient: preflight
   passes, relaunched on the same nodes). Each fault lands at a random step after the previous resume.

Printed: per failure the step, its classification, time to recover (detection → first step of the next
attempt), time lost (silence + recovery + redone steps) and steps redone; then the train stage of the chaos
run against the baseline (ratio), and the interruption rate. Ratios come from one run on this machine.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/recovery.py [--failures 3] [--steps 60] [--seed 7]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._support import mark_unhealthy, recovery_spec, run_under_chaos


def run(tmp: Path, steps: int, ckpt: int, faults_at: list[int], seed: int):
    import yaml

    from nightloom.ledger import Ledger
    from nightloom.provision.local import unhealthy_dir
    from nightloom.spec.load import load_spec

    tmp.mkdir(parents=True)
    spec_path = recovery_spec(tmp, nodes=2, ranks=2, steps=steps, max_attempts=len(faults_at) + 1, spare_nodes=1)
    data = yaml.safe_load(spec_path.read_text())
    data["train"]["checkpoint_every"] = ckpt
    data["train"]["seq_len"] = 128
    spec_path.write_text(yaml.safe_dump(data))
    spec = load_spec(spec_path)
    rng = random.Random(seed)
    faults = []
    for i, step in enumerate(faults_at):
        if i == 0:
            faults.append((0, step, 2, lambda: mark_unhealthy(unhealthy_dir(spec), "local-1")))
        else:
            faults.append((i, step, rng.randrange(4), None))
    chaos, state = run_under_chaos(spec_path, tmp / "runs", faults)
    if not state.is_completed():
        raise SystemExit(f"run failed: {state.message}")
    summary = state.result()
    with Ledger(spec.ledger.url) as ledger:
        row = ledger.get(summary.run_id)
    train_s = next(s.seconds for s in summary.stages if s.stage == "train")
    return summary, row, train_s, chaos.done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--failures", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    span = args.steps // (args.failures + 1)
    # fault i lands in the i-th slice of the run, past its first checkpoint (so something is resumed)
    faults_at = [
        i * span + args.checkpoint_every + 1 + rng.randrange(max(1, span - args.checkpoint_every - 1))
        for i in range(args.failures)
    ]
    from prefect.testing.utilities import prefect_test_harness

    with tempfile.TemporaryDirectory() as d, prefect_test_harness(server_startup_timeout=180):
        base, _, base_train, _ = run(Path(d) / "baseline", args.steps, args.checkpoint_every, [], args.seed)
        chaos, row, chaos_train, done = run(Path(d) / "chaos", args.steps, args.checkpoint_every, faults_at, args.seed)
    print(
        f"\nrecovery benchmark: tiny model, 2 nodes × 2 CPU ranks (+1 spare), {args.steps} steps, checkpoint "
        f"every {args.checkpoint_every}, seed {args.seed}, {len(done)} failure(s) injected at steps "
        f"{[s for _, s, _ in done]} (planned {faults_at})"
    )
    print(f"{'#':>2} {'kind':<10} {'recover s':>10} {'lost s':>8}  how it resumed")
    for i, it in enumerate(row.interruptions):
        how = it.detail.rsplit("; resumed", 1)[-1] if "; resumed" in it.detail else it.detail[-100:]
        print(
            f"{i:>2} {it.kind:<10} {it.recovery_s if it.recovery_s is not None else float('nan'):>10.2f} "
            f"{it.lost_s or 0:>8.2f}  resumed{how}"
        )
    rec = [it.recovery_s for it in row.interruptions if it.recovery_s is not None]
    lost = sum(it.lost_s or 0 for it in row.interruptions)
    print(
        f"time to recover: mean {sum(rec) / max(1, len(rec)):.2f} s, max {max(rec, default=0):.2f} s "
        f"(detection → first step of the next attempt)"
    )
    print(
        f"train stage: baseline {base_train:.1f} s, with {len(done)} failure(s) {chaos_train:.1f} s → "
        f"overhead ×{chaos_train / base_train:.2f}; time lost (ledger) {lost:.1f} s = "
        f"{lost / chaos_train:.0%} of the chaos train stage"
    )
    print(
        f"interruption rate: {row.interruption_count / (chaos_train / 3600):.0f}/h of training; final loss "
        f"baseline {base.last_loss:.6f} vs chaos {chaos.last_loss:.6f} (Δ {abs(base.last_loss - chaos.last_loss):.1e})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
