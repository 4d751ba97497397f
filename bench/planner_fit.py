"""Honest fit of the planner's one efficiency factor against published runs: fitted rows and held-out rows apart.

For every row of the reference table (default datasets/reference/published_runs.csv, or the path given), the
published layout is evaluated as a what-if (native_trainer=False: the rules that are limits of nightloom's trainer,
such as CP with PP, are not applied): tp, pp, dp, cp and whatever else the source publishes (recompute, FSDP) are
pinned, the rest (micro-batch, interleaving, stage split, unpublished recompute) is the planner's choice. Its
predicted TFLOP/s per GPU is compared with the published figure in the source's own accounting (`metric`: PTD-P's
HFU, Megatron's model FLOPs with logits, PaLM's MFU). Views:
  1. the shipped DEFAULT_EFFICIENCY (fitted on PTD-P rows 1–4): every row, fitted and not fitted apart;
  2. fit on the shallow rows (pp <= 2 of PTD-P and Megatron-Core) and test on the deep ones and Llama 3;
  3. leave-one-out: each row predicted by the factor fitted (mean error zero) on all the other rows;
  4. per row, the bubble's and the pipeline p2p's share of the step and how much slower the slowest pipeline rank
     is than the mean one, to see where the deep-pipeline error comes from.
`--materialized` evaluates every row with stored attention scores (the model before fused_attention) for comparison.

    PYTHONPATH=. python bench/planner_fit.py [published_runs.csv] [--materialized]
"""

from __future__ import annotations

import csv
import sys
import time
from dataclasses import replace
from pathlib import Path

from nightloom.catalog import MODELS, get_gpu
from nightloom.perf import flops_per_token
from nightloom.planner.request import PlanRequest, parse_layout
from nightloom.planner.search import search
from nightloom.planner.steptime import DEFAULT_EFFICIENCY, step_time

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT / "datasets" / "reference" / "published_runs.csv"
SHIPPED_FIT = 4  # DEFAULT_EFFICIENCY was fitted on the first four rows (PTD-P 1.7B–18.4B)
GPUS_PER_NODE = 8  # every source here ran 8-GPU nodes


def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def layout(row: dict) -> str:
    """The published degrees and settings as a --layout string (blank columns are left to the planner)."""
    parts = [f"tp={row['tp']}", f"pp={row['pp']}", f"dp={row['dp']}", f"cp={row.get('cp') or 1}"]
    if row.get("zero"):
        parts.append(f"zero={row['zero']}")
    if row.get("recompute"):
        parts.append(f"recompute={row['recompute']}")
    if row["source"] == "ptdp2021":
        parts.append("sp=0")  # PTD-P predates sequence parallelism
    return ",".join(parts)


def request(row: dict, eff: float, materialized: bool = False, memory_free: bool = False) -> PlanRequest:
    """The what-if request of a row; `memory_free` lifts the memory limit (the published run did fit: this judges
    the step-time model alone where the memory model would force another micro-batch, interleave or recompute)."""
    n = int(row["num_gpus"])
    gpu = get_gpu(row["gpu"])
    return PlanRequest(
        shape=MODELS[row["model"]],
        gpu=replace(gpu, memory_gib=1e6) if memory_free else gpu,
        nodes=n // GPUS_PER_NODE,
        gpus_per_node=GPUS_PER_NODE,
        seq_len=int(row["seq_len"]),
        global_batch=int(row["global_batch"]),
        fixed=parse_layout(layout(row)),
        efficiency=eff,
        native_trainer=False,
        fused_attention=row.get("attention") == "fused" and not materialized,
    )


def accounting(row: dict) -> float:
    """FLOPs per token in the source's own count (the header of published_runs.csv says which)."""
    shape, seq = MODELS[row["model"]], int(row["seq_len"])
    metric = row["metric"]
    if metric == "hfu":  # PTD-P: full recompute counted, logits included
        return flops_per_token(shape, seq, "full", hardware=True, lm_head=True)
    if metric == "mfu_megatron":
        return flops_per_token(shape, seq, lm_head=True)
    if metric == "mfu_palm":
        return flops_per_token(shape, seq)
    raise ValueError(f"{row['source']} {row['model']}: unknown metric {metric!r}")


def predict(row: dict, eff: float, materialized: bool = False, memory_free: bool = False):
    """(predicted TFLOP/s per GPU in the row's accounting, the evaluated plan, its request)."""
    req = request(row, eff, materialized, memory_free)
    p = search(req).chosen
    return p.tokens_per_s * accounting(row) / int(row["num_gpus"]) / 1e12, p, req


#: efficiencies at which every row is predicted once; fits interpolate between them (a search per row per point)
GRID = [0.44 + 0.02 * i for i in range(15)]


def curves(rs: list[dict], materialized: bool = False) -> list[list[float]]:
    """Predicted TFLOP/s per GPU of every row at every GRID efficiency."""
    return [[predict(r, e, materialized)[0] for e in GRID] for r in rs]


def at(curve: list[float], eff: float) -> float:
    """A row's prediction at `eff`, linear between the GRID points (throughput is smooth in the efficiency)."""
    k = min(max(int((eff - GRID[0]) / (GRID[1] - GRID[0])), 0), len(GRID) - 2)
    w = (eff - GRID[k]) / (GRID[k + 1] - GRID[k])
    return curve[k] * (1 - w) + curve[k + 1] * w


def fit(train: list[int], rs: list[dict], cs: list[list[float]]) -> float:
    """The efficiency whose mean relative error over rows `train` is zero (bisection: throughput grows with it)."""
    lo, hi = GRID[0], GRID[-1]
    for _ in range(40):
        mid = (lo + hi) / 2
        err = sum(at(cs[i], mid) / float(rs[i]["tflops_per_gpu"]) - 1 for i in train) / len(train)
        lo, hi = (mid, hi) if err < 0 else (lo, mid)
    return (lo + hi) / 2


def _err(pred: float, row: dict) -> float:
    return pred / float(row["tflops_per_gpu"]) - 1


def _summary(label: str, errs: list[float]) -> str:
    if not errs:
        return f"{label}: none"
    mean = sum(errs) / len(errs)
    worst = max(errs, key=abs)
    return f"{label}: {len(errs)} rows, mean {100 * mean:+.1f}%, mean |err| {100 * sum(map(abs, errs)) / len(errs):.1f}%, worst {100 * worst:+.1f}%"


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    materialized = "--materialized" in sys.argv
    path = Path(args[0]) if args else DEFAULT_CSV
    rs = rows(path)
    tag = " (every row with materialized attention scores)" if materialized else ""
    print(f"reference: {path} ({len(rs)} rows){tag}")

    # 1 + 4: the shipped factor, per row, with the pipeline diagnostics
    print(f"\n1. shipped efficiency {DEFAULT_EFFICIENCY} (fitted on rows 1–{SHIPPED_FIT}, PTD-P 1.7B–18.4B)")
    print(
        f"{'row':>3} {'source':<11} {'model':<11} {'layout':<20} {'v':>2} {'mb':>2} {'rc':<4} {'pub':>6} "
        f"{'pred':>6} {'err':>7} {'set':<8} bubble  p2p  slowest  time-only (v, mb, rc)"
    )
    shipped_fit, shipped_rest = [], []
    for i, r in enumerate(rs):
        pred, p, req = predict(r, DEFAULT_EFFICIENCY, materialized)
        st = step_time(
            req.shape, p.dims(), req.seq_len, req.gpu, GPUS_PER_NODE, DEFAULT_EFFICIENCY, "bf16", req.fused_attention
        )
        e = _err(pred, r)
        kind = "fitted" if i < SHIPPED_FIT else "held-out"
        (shipped_fit if i < SHIPPED_FIT else shipped_rest).append(e)
        lay = f"{r['tp']}·{r['pp']}·{r['dp']}" + (f"·cp{r['cp']}" if r.get("cp", "1") not in ("", "1") else "")
        excess = st.slot_max_s / st.slot_avg_s - 1 if st.slot_avg_s else 0.0
        free, q, _ = predict(r, DEFAULT_EFFICIENCY, materialized, memory_free=True)
        alt = (
            ""
            if abs(free - pred) < 1e-6 * pred
            else f"{100 * _err(free, r):+.1f}% ({q.virtual_stages}, {q.micro_batch}, {q.recompute})"
        )
        print(
            f"{i + 1:>3} {r['source']:<11} {r['model']:<11} {lay:<20} {p.virtual_stages:>2} {p.micro_batch:>2} "
            f"{p.recompute[:4]:<4} {float(r['tflops_per_gpu']):>6.1f} {pred:>6.1f} {100 * e:>+6.1f}% {kind:<8} "
            f"{100 * st.bubble_s / st.step_s:>5.1f}% {100 * st.pp_comm_s / st.step_s:>4.1f}% {100 * excess:>6.1f}%  {alt}"
            + ("" if p.fits else "  (no setting fits the memory model)")
        )
    print(_summary("   fitted", shipped_fit))
    print(_summary("   not fitted", shipped_rest))

    cs = curves(rs, materialized)
    # 2: fit on the shallow rows, test on the deep ones
    shallow = [
        i for i, r in enumerate(rs) if r["source"] in ("ptdp2021", "mcore2024") and int(r["pp"]) <= 2 and r["cp"] == "1"
    ]
    eff = fit(shallow, rs, cs)
    print(f"\n2. fitted on the {len(shallow)} rows with pp <= 2 (PTD-P, Megatron-Core): efficiency {eff:.3f}")
    fitted, rest = [], []
    for i, r in enumerate(rs):
        pred = at(cs[i], eff)
        e = _err(pred, r)
        (fitted if i in shallow else rest).append(e)
        print(
            f"{i + 1:>3} {r['model']:<13} pp={r['pp']:<3} pub {float(r['tflops_per_gpu']):>6.1f} pred {pred:>6.1f} "
            f"{100 * e:>+6.1f}% {'fitted' if i in shallow else 'test'}"
        )
    print(_summary("   fitted", fitted))
    print(_summary("   test (not fitted)", rest))

    # 3: leave-one-out
    print("\n3. leave-one-out: each row predicted by the factor fitted on all the others")
    loo = []
    for i, r in enumerate(rs):
        e_i = fit([j for j in range(len(rs)) if j != i], rs, cs)
        pred = at(cs[i], e_i)
        loo.append(_err(pred, r))
        print(f"{i + 1:>3} {r['model']:<13} eff {e_i:.3f} pred {pred:>6.1f} {100 * loo[-1]:>+6.1f}%")
    print(_summary("   leave-one-out", loo))

    # planning time of the largest published job, searched in full (nothing pinned)
    req = PlanRequest(
        shape=MODELS["llama3-405b"], gpu=get_gpu("h100-80gb"), nodes=2048, gpus_per_node=8, seq_len=8192,
        global_batch=2048, fused_attention=not materialized,
    )  # fmt: skip
    t0 = time.perf_counter()
    rep = search(req)
    dt = time.perf_counter() - t0
    c = rep.chosen
    print(
        f"\nplanning llama3-405b on 16,384 × h100-80gb (seq 8192, batch 2048, full search): {dt:.2f} s, "
        f"{rep.considered:,} candidates; chosen {c.layout()} v={c.virtual_stages} mb={c.micro_batch} "
        f"recompute={c.recompute} MFU {c.mfu:.1%}"
    )


if __name__ == "__main__":
    main()
