"""The ranks' peak RSS in XTuner's per-step log, measured as the native trainer measures it on CPU.

Runs inside the XTuner env (node_wrapper.py puts this folder on sys.path; the CPU config names the hook as
"nightloom_memory.PeakMemoryHook"), so it imports torch and mmengine only. The measurement itself is
nightloom/peak_rss.py, loaded by its path (that file is standard library only): one function for both
backends, the process's peak RSS since it started, never reset, the most over the ranks.

mmengine logs `memory` (MiB) only when CUDA is there; on CPU this hook sets it: nightloom.finetune.logs reads it
into StepMetrics.peak_mem_bytes either way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
from mmengine.hooks import Hook

PEAK_RSS = Path(__file__).resolve().parents[2] / "peak_rss.py"


def _load_peak_rss():
    """nightloom.peak_rss.peak_rss_bytes, loaded from its file (no nightloom package in this env)."""
    spec = importlib.util.spec_from_file_location("nightloom_peak_rss", PEAK_RSS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.peak_rss_bytes


peak_rss_bytes = _load_peak_rss()


def ranks_peak_bytes() -> int:
    """This rank's peak RSS, or the most over the ranks (a MAX all-reduce, as the native trainer does)."""
    peak = peak_rss_bytes()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([float(peak)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak = int(t.item())
    return peak


class PeakMemoryHook(Hook):
    """After every training step: the ranks' peak RSS, in MiB, as the `memory` scalar of that step's log line
    and vis_data/scalars.json. Priority NORMAL: before the LoggerHook (BELOW_NORMAL) writes the step out."""

    priority = "NORMAL"

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        runner.message_hub.update_scalar("train/memory", ranks_peak_bytes() / 2**20)
