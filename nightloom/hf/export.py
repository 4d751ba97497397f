"""A native DCP checkpoint -> a Hugging Face folder transformers loads with `from_pretrained`.

config.json (the source config when the run started from one), generation_config.json, consolidated
`model-XXXXX-of-YYYYY.safetensors` + `model.safetensors.index.json`, and the tokenizer's files. Tensors are
read from the checkpoint one layer at a time (one process, no process group), so memory holds one layer and
one output file, never the optimizer state. A mixture-of-experts layer's stacked experts are written in the Hub's
per-expert layout (one tensor per expert and matrix, hf/names.py), as transformers 5.24's save_pretrained does.
Vocabulary rows padded for TP are cut off. Everything is written to a temporary folder that is renamed into place
last: a reader never sees a half-written export.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nightloom.hf.config import config_for_export, config_path, read_config
from nightloom.hf.load import INDEX_NAME
from nightloom.hf.names import expert_names, to_hf
from nightloom.shape import ModelShape
from nightloom.util import atomic_write_text

if TYPE_CHECKING:  # train/lora.py imports torch, which `nightloom export --help` need not load
    from nightloom.train.lora import LoraSettings

DTYPES = ("bf16", "fp32")
ADAPTER_DIR = "adapter"  # a LoRA run's PEFT adapter, inside the export
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
    lora: LoraSettings | None = None,
) -> Path:
    """Write the export of DCP checkpoint `ckpt` (a `step-N` folder) to `out`; returns `out`. A LoRA run's (`lora`)
    is the merged model there and its adapter, as PEFT writes one, in `out/adapter/`."""
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

    adapters: dict[str, torch.Tensor] = {}
    for group in _groups(keys):
        state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in group}
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
        if lora is not None:
            state, found = merge_lora(state, lora.scaling)
            adapters |= {"base_model.model." + to_hf(k[len("model.") :], shape): t for k, t in found.items()}
        elif any(".lora_" in k for k in state):
            raise ValueError(f"{ckpt}: holds LoRA adapters but no train.lora settings were given to merge them")
        for k in sorted(state):
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
            per_expert = expert_names(ours, shape) if shape.moe else None
            for name, part in zip(per_expert, t) if per_expert is not None else [(to_hf(ours, shape), t)]:
                pending[name] = part.contiguous()
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
    if lora is not None:
        write_peft_adapter(tmp / ADAPTER_DIR, adapters, lora, torch_dtype, base=str(source_config or ""))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def merge_lora(state: dict, scaling: float) -> tuple[dict, dict]:
    """(base tensors with W + scaling · B A merged in fp32, the adapters' tensors) of one group of checkpoint keys."""
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    merged = {k: v for k, v in state.items() if ".lora_" not in k}
    for k in [k for k in adapters if k.endswith(".lora_A.weight")]:
        stem = k[: -len(".lora_A.weight")]
        a, b = adapters[k].float(), adapters[f"{stem}.lora_B.weight"].float()
        w = merged[f"{stem}.weight"]
        merged[f"{stem}.weight"] = (w.float() + scaling * (b @ a)).to(w.dtype)
    return merged, adapters


def write_peft_adapter(folder: Path, tensors: dict, lora: LoraSettings, dtype, base: str) -> None:
    """adapter_config.json and adapter_model.safetensors as peft's save_pretrained writes them (key names
    `base_model.model.<HF name>.lora_A.weight`), so `PeftModel.from_pretrained(base, folder)` loads them."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(dtype).contiguous() for k, v in sorted(tensors.items())}, str(folder / "adapter_model.safetensors")
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(Path(base).parent) if base else None,
    }
    atomic_write_text(folder / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
