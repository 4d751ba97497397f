"""Honest fit of the planner's one efficiency factor against published runs: fitted rows and held-out rows apart.

For every row of the reference table (default ../shared/reference/published_runs.csv, or the path given), the
published layout is evaluated (a what-if: PTD-P ties embeddings across TP/PP, which nightloom's trainer does not
run) and its predicted TFLOP/s per GPU compared with the published figure in the same accounting (PTD-P's HFU).
Three views: (1) the shipped DEFAULT_EFFICIENCY, fitted on rows 1–4, with rows 5–8 held out; (2) leave-one-out:
each row predicted by the factor fitted (mean error zero) on all the other rows; (3) per row, the bubble's and the
pipeline p2p's share of the step and how much slower the last stage (with the output head) is than the mean
stage, to see where the deep-pipeline error comes from.

    PYTHONPATH=. python bench/planner_fit.py [published_runs.csv]
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from nightloom.catalog import MODELS, get_gpu
from nightloom.perf import flops_per_token
from nightloom.planner.request import PlanRequest, parse_layout
from nightloom.planner.search import search
from nightloom.planner.steptime import DEFAULT_EFFICIENCY

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT.parent / "shared" / "reference" / "published_runs.csv"
FITTED = 4  # DEFAULT_EFFICIENCY was fitted on the first four rows


def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def predict(row: dict, eff: float) -> tuple[float, object]:
    """Predicted TFLOP/s per GPU (PTD-P accounting) of the published layout at efficiency `eff`."""
    shape, n = MODELS[row["model"]], int(row["num_gpus"])
    req = PlanRequest(
        shape=shape,
        gpu=get_gpu(row["gpu"]),
        nodes=n // 8,
        gpus_per_node=8,
        seq_len=int(row["seq_len"]),
        global_batch=int(row["global_batch"]),
        fixed=parse_layout(f"tp={row['tp']},pp={row['pp']},dp={row['dp']},zero=none,sp=0,recompute={row['recompute']}"),
        efficiency=eff,
        native_trainer=False,
    )
    p = search(req).chosen
    f = flops_per_token(shape, int(row["seq_len"]), "full", hardware=True, lm_head=True)
    return p.tokens_per_s * f / n / 1e12, p


def fit(train: list[dict]) -> float:
    """The efficiency whose mean relative error over `train` is zero (bisection: throughput grows with it)."""
    lo, hi = 0.2, 0.95
    for _ in range(30):
        mid = (lo + hi) / 2
        err = sum(predict(r, mid)[0] / float(r["tflops_per_gpu"]) - 1 for r in train) / len(train)
        lo, hi = (mid, hi) if err < 0 else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CSV
    if not path.is_file():
        path = Path("/work/shared/reference/published_runs.csv")
    rs = rows(path)
    print(f"reference: {path} ({len(rs)} rows); shipped efficiency {DEFAULT_EFFICIENCY} (fitted on rows 1–{FITTED})")
    print(
        f"{'row':>3} {'model':<11} {'layout':<12} {'pub':>5} {'shipped':>8} {'err':>7} {'set':<9} "
        f"{'LOO eff':>7} {'LOO pred':>8} {'LOO err':>7}  bubble  p2p  last-stage excess"
    )
    for i, r in enumerate(rs):
        pub = float(r["tflops_per_gpu"])
        pred, p = predict(r, DEFAULT_EFFICIENCY)
        eff = fit(rs[:i] + rs[i + 1 :])
        loo, _ = predict(r, eff)
        st = p.step_time_s
        bubble = next((x for x in p.explanation if x.startswith("step ")), "")
        b = float(bubble.split("bubble ")[1].split(" ")[0]) / st if "bubble " in bubble else 0.0
        q = float(bubble.split("PP p2p ")[1].split(",")[0]) / st if "PP p2p " in bubble else 0.0
        pipe = next((x for x in p.explanation if x.startswith("pipeline: ")), "")
        imb = 0.0
        if pipe:
            smax = float(pipe.split("(slot ")[1].split(" ms")[0])
            savg = float(pipe.split("mean ")[1].split(" ms")[0])
            imb = smax / savg - 1
        lay = f"{r['tp']}·{r['pp']}·{r['dp']}·v{p.virtual_stages}"
        kind = "fitted" if i < FITTED else "held-out"
        print(
            f"{i + 1:>3} {r['model']:<11} {lay:<12} {pub:>5.0f} {pred:>8.1f} {100 * (pred / pub - 1):>+6.1f}% "
            f"{kind:<9} {eff:>7.3f} {loo:>8.1f} {100 * (loo / pub - 1):>+6.1f}%  {100 * b:>5.1f}% {100 * q:>4.1f}% {100 * imb:>6.1f}%"
        )


if __name__ == "__main__":
    main()
