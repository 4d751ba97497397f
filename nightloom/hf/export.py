"""A native DCP checkpoint -> a Hugging Face folder transformers loads with `from_pretrained`.

config.json (the source config when the run started from one), generation_config.json, consolidated
`model-XXXXX-of-YYYYY.safetensors` + `model.safetensors.index.json`, and the tokenizer's files. Tensors are
read from the checkpoint one layer at a time (one process, no process group), so memory holds one layer and
one output file, never the optimizer state. Vocabulary rows padded for TP are cut off. Everything is
written to a temporary folder that is renamed into place last: a reader never sees a half-written export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from nightloom.hf.config import config_for_export, config_path, read_config
from nightloom.hf.load import INDEX_NAME
from nightloom.hf.names import to_hf
from nightloom.shape import ModelShape
from nightloom.util import atomic_write_text

DTYPES = ("bf16", "fp32")
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size
_TOKENIZER_FILES = re.compile(r"(tokenizer.*|special_tokens_map\.json|.*\.model|.*\.tiktoken|vocab\.json|merges\.txt)")


@dataclass(frozen=True)
class ExportReport:
    folder: Path
    tensors: int
    bytes: int
    files: int


def tokenizer_files(tokenizer: str | Path | None) -> list[Path]:
    """The files of a tokenizer to ship with a model: a file itself, or a folder's tokenizer files."""
    if tokenizer is None or str(tokenizer) == "bytes":
        return []
    p = Path(tokenizer)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.is_file() and _TOKENIZER_FILES.fullmatch(f.name))
    return []


def tokenizer_source(spec) -> str | None:
    """The tokenizer file or folder a run spec names (`model.tokenizer`), or None for bytes / none."""
    tok = getattr(spec.model, "tokenizer", None)
    path = getattr(tok, "path", tok)
    return path if isinstance(path, str) and path != "bytes" else None


def _groups(names: list[str]) -> list[list[str]]:
    """Checkpoint model keys grouped per layer (and one group for the rest), in layer order."""
    by_layer: dict[int, list[str]] = {}
    rest: list[str] = []
    for n in names:
        m = re.match(r"model\.layers\.(\d+)\.", n)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(n)
        else:
            rest.append(n)
    return [sorted(rest)] + [sorted(by_layer[i]) for i in sorted(by_layer)]


def export_checkpoint(
    ckpt: Path,
    shape: ModelShape,
    out: Path,
    dtype: str = "bf16",
    source_config: str | Path | None = None,
    tokenizer: str | Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the export of DCP checkpoint `ckpt` (a `step-N` folder) to `out`; returns `out`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r}; expected one of {', '.join(DTYPES)}")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    keys = [k for k in meta if k.startswith("model.")]
    if not keys:
        raise ValueError(f"{ckpt}: no model tensors in this checkpoint")
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []
    total = 0

    def flush() -> None:
        if pending:
            name = f"part-{len(files):05d}.safetensors"
            save_file(pending, str(tmp / name), metadata={"format": "pt"})
            files.append(sorted(pending))
            pending.clear()

    for group in _groups(keys):
        state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in group}
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
        for k in group:
            ours = k[len("model.") :]
            if shape.tied_embeddings and ours == "output.weight":
                continue  # transformers re-ties lm_head to the embedding
            t = state[k]
            if ours in ("tok_embeddings.weight", "output.weight"):
                t = t[: shape.vocab]  # rows padded for TP
            t = t.to(torch_dtype).contiguous()
            nbytes = t.numel() * t.element_size()
            if pending and sum(x.numel() * x.element_size() for x in pending.values()) + nbytes > max_shard_bytes:
                flush()
            pending[to_hf(ours, shape)] = t
            total += nbytes
        del state
    flush()
    n = len(files)
    for i, names in enumerate(files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / f"part-{i:05d}.safetensors", tmp / final)
        weight_map |= {name: final for name in names}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(tmp / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    source = read_config(source_config) if source_config else None
    cfg = config_for_export(shape, source, dtype)
    atomic_write_text(tmp / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_src = config_path(source_config).with_name("generation_config.json") if source_config else None
    if gen_src is not None and gen_src.is_file():
        shutil.copyfile(gen_src, tmp / "generation_config.json")
    else:
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        atomic_write_text(tmp / "generation_config.json", json.dumps(gen, indent=2) + "\n")
    for f in tokenizer_files(tokenizer):
        shutil.copyfile(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
