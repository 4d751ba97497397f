"""PNG plots for the Prefect UI and the run folder: loss, tokens/s and MFU per step, predicted vs measured MFU, and a
mixture-of-experts run's tokens per expert per step.

Uses matplotlib's object API with the Agg canvas directly (no pyplot, no global backend switch), so it is
safe in worker threads and headless nodes. Every PNG is written atomically (temp file, then os.replace).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from nightloom.metrics import StepMetrics
from nightloom.util import share_mode


@dataclass(frozen=True)
class MfuPoint:
    """One run on the predicted-vs-measured MFU plot."""

    label: str
    predicted: float
    measured: float


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
        share_mode(tmp)  # mkstemp made it 0600: the usual mode, as the run's other files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _axes(size: tuple[float, float] = (7, 4)):
    """A figure of `size` inches and its one axes."""
    fig = Figure(figsize=size)
    return fig, fig.add_subplot()


def _finish(fig: Figure, ax, path: str | Path, legend: str | None = None) -> Path:
    """Grid (and a legend at `legend`) on `ax`, then the figure saved to `path`."""
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(loc=legend)
    return _save(fig, Path(path))


def _series(steps: Sequence[StepMetrics], attr: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for m in steps:
        v = getattr(m, attr)
        if v is not None and math.isfinite(v):
            xs.append(m.step)
            ys.append(float(v))
    return xs, ys


def _mark_events(ax, steps: Sequence[StepMetrics], nan: bool = False) -> None:
    """Dashed lines at resumes (gap steps) and, with `nan`, red crosses at non-finite losses."""
    label = "resume"
    for m in steps:
        if m.gap:
            ax.axvline(m.step, color="grey", ls="--", lw=0.8, label=label)
            label = None
    bad = [m.step for m in steps if nan and not math.isfinite(m.loss)]
    if bad:
        ax.scatter(
            bad,
            [0] * len(bad),
            marker="x",
            color="red",
            zorder=3,
            label="NaN/Inf loss",
            transform=ax.get_xaxis_transform(),
        )


def plot_loss(
    steps: Sequence[StepMetrics], path: str | Path, golden: Sequence[StepMetrics] | None = None, title: str = "loss"
) -> Path:
    fig, ax = _axes()
    ax.plot(*_series(steps, "loss"), lw=1.2, label="loss")
    ex, ey = _series(steps, "eval_loss")
    if ex:
        ax.plot(ex, ey, marker="o", ms=3, lw=1, color="tab:purple", label="held-out eval loss")
    if golden:
        ax.plot(*_series(golden, "loss"), lw=1, ls=":", color="black", label="golden")
    _mark_events(ax, steps, nan=True)
    ax.set(xlabel="step", ylabel="loss", title=title)
    return _finish(fig, ax, path, "upper right")


def plot_throughput(steps: Sequence[StepMetrics], path: str | Path, title: str = "tokens/s") -> Path:
    fig, ax = _axes()
    ax.plot(*_series(steps, "tokens_per_s"), lw=1.2, color="tab:green")
    _mark_events(ax, steps)
    ax.set(xlabel="step", ylabel="tokens/s (global)", title=title)
    return _finish(fig, ax, path)


def plot_mfu(
    steps: Sequence[StepMetrics],
    path: str | Path,
    predicted: float | None = None,
    floor: float | None = None,
    title: str = "MFU",
) -> Path:
    fig, ax = _axes()
    xs, ys = _series(steps, "mfu")
    ax.plot(xs, [100 * y for y in ys], lw=1.2, color="tab:orange", label="measured MFU")
    hx, hy = _series(steps, "hfu")
    if hy:
        ax.plot(hx, [100 * y for y in hy], lw=1, ls="--", color="tab:orange", alpha=0.6, label="HFU")
    if predicted is not None:
        ax.axhline(100 * predicted, color="tab:blue", ls="--", label=f"predicted {predicted:.1%}")
    if floor:
        ax.axhline(100 * floor, color="tab:red", ls=":", label=f"floor {floor:.1%}")
    _mark_events(ax, steps)
    ax.set(xlabel="step", ylabel="MFU (%)", title=title)
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, path, "lower right")


def plot_eval(steps: Sequence[StepMetrics], path: str | Path, title: str = "held-out evaluation") -> Path:
    """Held-out token-weighted mean NLL and perplexity at each evaluation."""
    fig, ax = _axes()
    ax.plot(*_series(steps, "eval_loss"), marker="o", ms=3, lw=1.2, color="tab:purple", label="eval loss")
    ax.set(xlabel="step", ylabel="eval loss (NLL / token)", title=title)
    ppl = ax.twinx()
    ppl.plot(*_series(steps, "eval_ppl"), ls="--", lw=1, color="tab:gray", label="perplexity")
    ppl.set_ylabel("perplexity")
    _mark_events(ax, steps)
    return _finish(fig, ax, path, "upper right")


def plot_expert_load(steps: Sequence[StepMetrics], path: str | Path, title: str = "tokens per expert") -> Path:
    """A mixture-of-experts run's router load: each expert's share of the step's top-k assignments (a heat map,
    experts by steps; a balanced router is one flat colour, 1/E each) and max/mean per step under it."""
    rows = [m for m in steps if m.expert_tokens]
    fig = Figure(figsize=(8, 5))
    heat, line = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    if rows:
        shares = [[n / max(sum(m.expert_tokens), 1) for n in m.expert_tokens] for m in rows]
        experts = len(shares[0])
        grid = [[s[e] for s in shares] for e in range(experts)]
        x0, x1 = rows[0].step - 0.5, rows[-1].step + 0.5
        img = heat.imshow(grid, aspect="auto", origin="lower", extent=(x0, x1, -0.5, experts - 0.5), cmap="viridis")
        fig.colorbar(img, ax=heat, label="share of assignments")
        line.axhline(1.0, color="grey", lw=0.8, ls="--", label="balanced")
    heat.set(ylabel="expert", title=title)
    line.plot(*_series(rows, "expert_imbalance"), lw=1.2, color="tab:red", label="max / mean")
    line.set(xlabel="step", ylabel="max / mean")
    return _finish(fig, line, path, "upper right")


def plot_predicted_vs_measured(
    points: Sequence[MfuPoint], path: str | Path, title: str = "predicted vs measured MFU"
) -> Path:
    """One dot per run; the diagonal is a perfect prediction."""
    fig, ax = _axes((5, 5))
    top = max([0.1] + [100 * max(p.predicted, p.measured) for p in points]) * 1.1
    ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--", label="measured = predicted")
    ax.scatter([100 * p.predicted for p in points], [100 * p.measured for p in points], zorder=3)
    for p in points:
        ax.annotate(
            p.label, (100 * p.predicted, 100 * p.measured), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.set(xlabel="predicted MFU (%)", ylabel="measured MFU (%)", title=title, xlim=(0, top), ylim=(0, top))
    return _finish(fig, ax, path, "upper left")


def write_run_plots(
    steps: Sequence[StepMetrics],
    out_dir: str | Path,
    *,
    predicted_mfu: float | None = None,
    mfu_floor: float | None = None,
    golden: Sequence[StepMetrics] | None = None,
    history: Sequence[MfuPoint] = (),
) -> dict[str, Path]:
    """All of a run's plots into `out_dir`: {'loss', 'tokens_per_s', 'mfu', 'eval' if the run evaluated,
    'experts' for a mixture of experts, and 'mfu_vs_plan' if history}."""
    out = Path(out_dir)
    paths = {
        "loss": plot_loss(steps, out / "loss.png", golden),
        "tokens_per_s": plot_throughput(steps, out / "tokens_per_s.png"),
        "mfu": plot_mfu(steps, out / "mfu.png", predicted_mfu, mfu_floor),
    }
    if any(m.eval_loss is not None for m in steps):
        paths["eval"] = plot_eval(steps, out / "eval.png")
    if any(m.expert_tokens for m in steps):
        paths["experts"] = plot_expert_load(steps, out / "experts.png")
    if history:
        paths["mfu_vs_plan"] = plot_predicted_vs_measured(history, out / "mfu_vs_plan.png")
    return paths
