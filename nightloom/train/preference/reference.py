"""The reference policy's log-probs for DPO and IPO (and any later task that scores against the initial model).

Three ways, chosen by train.preference.reference:
- adapters_off (LoRA): the same model with every adapter's contribution set to 0 for one no-grad forward, which is
  the frozen base exactly (no second copy of the weights, as TRL and PEFT do with `disable_adapter`).
- frozen_copy (full fine-tuning): a second model built as the policy is (`frozen_copy`: the same plan, so FSDP2
  shards and TP splits it over the same ranks) holding the initial weights, without gradients or optimizer state,
  one no-grad forward per micro-batch (TRL's `ref_model`); rebuilt from the initial weights on resume.
- precomputed (full fine-tuning): every training and held-out pair scored once with the initial weights before
  the first step, each DP rank a share, all-reduced, and stored beside the shards as
  `<shards>/reference/<key>.npy` (written then renamed), `key` hashing the model (its weights files' names,
  sizes and mtimes, or the seed and shape of a random start), the shards' hashes, the data order's seed and the
  loss's averaging; the next night and a run resumed after a preemption load it instead of the (now trained)
  model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from nightloom.train.preference.logps import SequenceLogps, sequence_logps

REFERENCE_DIR = "reference"


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every LoRA adapter's scaling set to 0 (its output then adds exactly 0), restored after."""
    adapted = [m for m in model.modules() if hasattr(m, "lora_scaling")]
    saved = [m.lora_scaling for m in adapted]
    for m in adapted:
        m.lora_scaling = 0.0
    try:
        yield
    finally:
        for m, s in zip(adapted, saved, strict=True):
            m.lora_scaling = s


def frozen_copy(job, device: torch.device) -> nn.Module:
    """The reference model of a full fine-tuning job: built by build_parts with the policy's plan (FSDP2 shards
    and TP splits on a mesh of the same ranks; pp = 1 for dpo), the initial weights (model.weights, or the seeded
    random start the policy began from), every parameter frozen, in eval mode. Collective: every rank calls it."""
    from nightloom.hf.load import fetch_weights, load_hf_weights
    from nightloom.train.parallelize import build_parts
    from nightloom.train.rank import precision_dtype

    plan, dims, shape = job.plan, job.plan.dims(), job.model
    if plan.tp > 1 and shape.vocab % plan.tp:  # as the trainer builds the policy
        shape = shape.padded_for_tp(plan.tp)
    mesh = dims.build_mesh(device.type) if dist.is_initialized() else None
    dtype = precision_dtype(job.train.precision, device.type)
    parts = build_parts(shape, plan, dims, mesh, job.train.seq_len, job.train.seed, device, dtype, loss_chunk=0)
    if job.weights:
        quiet = lambda _: None  # noqa: E731 - the policy's load already logged the weights
        load_hf_weights(parts.parts, fetch_weights(job.weights, job.s3, log=quiet), shape, log=quiet)
    (model,) = parts.parts
    model.requires_grad_(False)
    return model.eval()


def weights_fingerprint(weights: str | None, seed: int, shape_name: str) -> dict:
    """What identifies the initial model: a local weights folder's files (name, size, mtime), an s3:// prefix by
    name, or the seed and shape of a random start."""
    if weights is None:
        return {"random": seed, "shape": shape_name}
    p = Path(weights).expanduser()
    if "://" in weights or not p.is_dir():
        return {"weights": weights}
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin", ".json"))
    return {"weights": str(p.resolve()), "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]}


def reference_key(model: dict, manifest, seed: int | None, eval_rows: int) -> str:
    """The stored table's name: the model's fingerprint, the shards' hashes, the order's seed, the eval rows."""
    shards = [s.token_files.bin_hash for s in manifest.shards if s.token_files is not None]
    held = manifest.heldout.token_files.bin_hash if manifest.heldout and manifest.heldout.token_files else None
    doc = {"model": model, "settings": manifest.settings_hash, "shards": shards, "heldout": held}
    doc |= {"seed": seed, "eval_rows": eval_rows}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def table_path(manifest_dir: str, key: str) -> Path:
    return Path(manifest_dir) / REFERENCE_DIR / f"{key}.npy"


def load_table(path: Path, rows: int) -> np.ndarray | None:
    """The stored (rows, 2) float64 table of summed (chosen, rejected) reference log-probs, or None."""
    if not path.is_file():
        return None
    table = np.load(path)
    return table if table.shape == (rows, 2) else None


def save_table(path: Path, table: np.ndarray) -> None:
    """Write then rename: a reader never sees half a table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, table)
    os.replace(tmp, path)


def compute_table(
    score: Callable[[int, int], SequenceLogps | None], rows: int, chunk: int, share: int, shares: int, device
) -> np.ndarray:
    """(rows, 2) summed reference log-probs: `score(start, n)` gives rows [start, start+n)'s [chosen; rejected]
    log-probs (None: this rank holds no result for them, e.g. a non-first TP rank); rank `share` of `shares`
    takes every shares-th chunk, and one all-reduce of the values and a count per row assembles the table."""
    values = torch.zeros((rows, 2), dtype=torch.float64, device=device)
    counts = torch.zeros((rows, 1), dtype=torch.float64, device=device)
    rounds = -(-rows // (chunk * shares))  # the same count of forwards on every rank (FSDP's collectives)
    for r in range(rounds):
        start = (r * shares + share) * chunk
        n = min(chunk, rows - start)
        got = score(start if n > 0 else 0, max(n, 1))
        if got is None or n <= 0:
            continue
        chosen, rejected = got.halves()
        values[start : start + n, 0] = chosen.total.double()
        values[start : start + n, 1] = rejected.total.double()
        counts[start : start + n] = 1.0
    both = torch.cat([values, counts], dim=1)
    if dist.is_initialized():
        dist.all_reduce(both)
    if bool((both[:, 2] < 1).any()):
        raise RuntimeError("reference log-probs: some pairs were scored by no rank")
    return (both[:, :2] / both[:, 2:]).cpu().numpy()


@torch.no_grad()
def score_pairs(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, autocast) -> SequenceLogps:
    """One no-grad forward over [chosen; rejected] rows: their summed completion log-probs."""
    with autocast():
        logits = model(inputs)
    return sequence_logps(logits, targets)
