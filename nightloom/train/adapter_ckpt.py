"""Adapter-only checkpoints of a LoRA run: the frozen base is never written again, only named by its fingerprint.

A LoRA run whose base lives outside its checkpoints (model.weights) saves the adapters and their optimizer state
alone (train/checkpoint.py: `adapters_only` in meta.json) and records the base's fingerprint there; a resume loads
the base from model.weights again, checks the fingerprint, then the adapters. A base that changed in between (other
weights, another quantization) is refused by name: the adapters were trained on the old one.

The fingerprint hashes every file of the weights folder a load reads (config.json and the *.safetensors, whole:
xxh3-128 over their bytes, read once from the page cache the load fills anyway) and the quantization settings.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_CHUNK = 16 * 2**20


class BaseChangedError(ValueError):
    """The checkpoint's adapters were trained on another base than the one this run loads."""


def base_fingerprint(folder: str | Path, quant=None) -> str:
    """Hex digest of the weights folder's config and tensors (and `quant`, a QuantSettings or None)."""
    import xxhash

    root = Path(folder)
    files = sorted([*root.glob("*.safetensors"), root / "config.json"])
    out = hashlib.sha256()
    for f in files:
        if not f.is_file():
            continue
        h = xxhash.xxh3_128()
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
        out.update(f"{f.name}\0{f.stat().st_size}\0{h.hexdigest()}\n".encode())
    q = None if quant is None else [quant.kind, quant.double_quant, str(quant.compute_dtype)]
    out.update(json.dumps({"quantize": q}).encode())
    return out.hexdigest()[:32]


def check_base(meta: dict, path: Path, fingerprint: str, weights: str) -> None:
    """Refuse to resume an adapter-only checkpoint (its meta.json) onto a base with another fingerprint."""
    if meta.get("adapters_only") and meta.get("base") != fingerprint:
        raise BaseChangedError(
            f"{path}: its adapters were trained on base {meta.get('base')}, but model.weights ({weights}) is now "
            f"{fingerprint} (changed weights or train.lora.quantize); resume onto the base they were trained on, "
            "or start a new run"
        )
