"""Run plots: real PNGs (decoded back), atomic writes, NaN and resume markers, predicted vs measured MFU."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.image import imread

from nightloom.metrics import StepMetrics
from nightloom.plots import MfuPoint, plot_loss, plot_predicted_vs_measured, write_run_plots


def run(n=30, nan_at=None, gap_at=None):
    out = []
    for s in range(1, n + 1):
        loss = float("nan") if s == nan_at else 2 + 3 * math.exp(-s / 8)
        out.append(StepMetrics(step=s, loss=loss, tokens_per_s=900 + s, mfu=0.3 + s / 1000, hfu=0.4, gap=s == gap_at))
    return out


def decode(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert img[..., :3].std() > 0.01  # something was drawn
    return img[..., :3]


def pure_red(img: np.ndarray) -> int:
    return int(((img[..., 0] > 0.9) & (img[..., 1] < 0.1) & (img[..., 2] < 0.1)).sum())


def test_write_run_plots(tmp_path: Path):
    hist = [MfuPoint("TP2·FSDP4", 0.45, 0.41), MfuPoint("TP4·PP2", 0.50, 0.38)]
    paths = write_run_plots(run(gap_at=12), tmp_path / "plots", predicted_mfu=0.35, mfu_floor=0.2, history=hist)
    assert set(paths) == {"loss", "tokens_per_s", "mfu", "mfu_vs_plan"}
    imgs = {k: decode(p) for k, p in paths.items()}
    assert not np.array_equal(imgs["loss"], imgs["tokens_per_s"])
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "loss.png",
        "mfu.png",
        "mfu_vs_plan.png",
        "tokens_per_s.png",
    ]  # no temp files left


def test_data_changes_the_picture_and_nan_is_marked(tmp_path: Path):
    a = decode(plot_loss(run(), tmp_path / "a.png"))
    rising = [m.model_copy(update={"loss": 1 + m.step / 10}) for m in run()]
    b = decode(plot_loss(rising, tmp_path / "b.png"))
    assert a.shape != b.shape or not np.array_equal(a, b)
    c = decode(plot_loss(run(nan_at=20), tmp_path / "c.png"))
    assert pure_red(a) == 0 and pure_red(c) > 0


def test_overwrite_and_empty_series(tmp_path: Path):
    p = tmp_path / "loss.png"
    p.write_bytes(b"old")
    plot_loss([StepMetrics(step=1, loss=3.0)], p)
    decode(p)
    decode(plot_predicted_vs_measured([], tmp_path / "empty.png"))


def test_eval_plot_only_when_the_run_evaluated(tmp_path: Path):
    evaluated = [
        m.model_copy(update={"eval_loss": 3 - m.step / 20, "eval_ppl": math.exp(3 - m.step / 20)})
        if m.step % 10 == 0
        else m
        for m in run()
    ]
    paths = write_run_plots(evaluated, tmp_path / "with")
    assert set(paths) == {"loss", "tokens_per_s", "mfu", "eval"}
    decode(paths["eval"])
    plain = write_run_plots(run(), tmp_path / "without")
    assert "eval" not in plain
    assert not np.array_equal(decode(paths["loss"]), decode(plain["loss"]))  # eval points drawn on the loss plot


def test_plots_get_the_umask_mode_as_the_run_s_other_files(tmp_path: Path):
    """mkstemp makes 0600: a teammate sharing the run folder could not open loss.png. Now 0666 less the umask."""
    import os
    import stat

    hist = [MfuPoint("a", 0.3, 0.25)]
    for mask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(mask)
        try:
            paths = write_run_plots(run(), tmp_path / f"plots-{mask:o}", predicted_mfu=0.35, history=hist)
        finally:
            os.umask(old)
        assert {k: stat.S_IMODE(p.stat().st_mode) for k, p in paths.items()} == dict.fromkeys(paths, mode)
