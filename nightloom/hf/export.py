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
from pathlib import Path
from typing import TYPE_CHECKING

from nightloom.hf.config import config_for_export, config_path, read_config
from nightloom.hf.load import INDEX_NAME
from nightloom.hf.names import expert_names, to_hf
from nightloom.shape import ModelShape
from nightloom.util import atomic_write_text, quiet_no_dist, share_mode

if TYPE_CHECKING:  # train/lora.py imports torch, which `nightloom export --help` need not load
    from nightloom.train.lora import LoraSettings

DTYPES = ("bf16", "fp32")
ADAPTER_DIR = "adapter"  # a LoRA run's PEFT adapter, inside the export
BASE_DIR = (
    "base"  # a LoRA run's unmerged base, inside the export, when no weights folder is its base (see adapter_base)
)
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size
#: a tokenizer's files and its chat templates (transformers 5 saves the default one as chat_template.jinja, which
#: wins over tokenizer_config.json's `chat_template`; older processors chat_template.json)
_TOKENIZER_FILES = re.compile(
    r"tokenizer.*|special_tokens_map\.json|added_tokens\.json|chat_template\.(jinja|json)|.*\.model|.*\.tiktoken"
    r"|vocab\.(json|txt)|merges\.txt"
)
TEMPLATE_FILE = "chat_template.jinja"
QUANT_CONFIG = "quantization_config.json"  # a QLoRA adapter's base quantization (BitsAndBytesConfig.to_dict)
TEMPLATE_DIR = "additional_chat_templates"  # transformers 5: named templates besides the default, one .jinja each


def tokenizer_files(tokenizer: str | Path | None) -> list[Path]:
    """The files of a tokenizer to ship with a model: a file itself, or a folder's tokenizer and chat-template files
    (additional_chat_templates/*.jinja included), so the export tokenizes and chats as the run did."""
    if tokenizer is None or str(tokenizer) == "bytes":
        return []
    p = Path(tokenizer)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    found = [f for f in p.iterdir() if f.is_file() and _TOKENIZER_FILES.fullmatch(f.name)]
    found += list((p / TEMPLATE_DIR).glob("*.jinja"))
    return sorted(found)


def _copy_tokenizer(tokenizer: str | Path | None, chat_template: str | Path | None, dest: Path) -> None:
    """The tokenizer's files into `dest` (a folder's layout kept), or the byte tokenizer's Hugging Face form for
    `bytes`, then the run's own template file (model.chat_template) as chat_template.jinja, which transformers
    prefers to the tokenizer's."""
    if str(tokenizer) == "bytes":
        from nightloom.hf.bytes_tokenizer import write_byte_tokenizer

        write_byte_tokenizer(dest)
    root = Path(tokenizer) if tokenizer is not None and Path(tokenizer).is_dir() else None
    for f in tokenizer_files(tokenizer):
        target = dest / (f.relative_to(root) if root is not None else f.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    if chat_template is not None:
        shutil.copyfile(Path(chat_template).expanduser(), dest / TEMPLATE_FILE)


def tokenizer_source(spec) -> str | None:
    """The tokenizer file or folder a run spec names (`model.tokenizer`), `bytes` for the byte tokenizer (its
    Hugging Face form is exported), or None."""
    tok = getattr(spec.model, "tokenizer", None)
    if getattr(tok, "is_bytes", False):
        return "bytes"
    path = getattr(tok, "path", tok)
    return path if isinstance(path, str) and path != "bytes" else None


def adapter_base(weights: str | None, out: Path) -> str:
    """`base_model_name_or_path` of a LoRA run's adapter, which `peft.AutoPeftModelForCausalLM` loads the adapter
    onto: the base model's own folder (absolute; a Hub id or s3:// prefix as given; PEFT cannot fetch s3://, so
    such a base must be fetched and given to PeftModel by hand). A run with no weights (model.config, random
    init) has no base anywhere but its checkpoint: the export writes that unmerged base to `<out>/base/` and the
    adapter names it. Not the merged export itself: the adapter on the merged weights would add B A twice."""
    if not weights:
        return str(Path(out).absolute() / BASE_DIR)
    p = Path(weights).expanduser()
    return str(p.resolve()) if "://" not in weights and p.exists() else weights


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


class _Shards:
    """safetensors files of at most `max_bytes` each in `folder`, renamed model-XXXXX-of-YYYYY once all are
    written, as save_pretrained names them, with their index."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: dict = {}
        self.pending_bytes = self.total = 0
        self.files: list[list[str]] = []

    def add(self, parts: list, nbytes: int) -> None:
        """One checkpoint tensor's Hugging Face tensors (several for stacked experts), kept in one file."""
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending |= dict(parts)
        self.pending_bytes += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.pending:
            self.folder.mkdir(parents=True, exist_ok=True)
            name = f"part-{len(self.files):05d}.safetensors"
            save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
            self.files.append(sorted(self.pending))
            self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """The last file, every file's final name, and model.safetensors.index.json."""
        self.flush()
        n, weight_map = len(self.files), {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / f"part-{i:05d}.safetensors", self.folder / final)
            weight_map |= {name: final for name in names}
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(self.folder / INDEX_NAME, json.dumps(index, indent=2) + "\n")


def _add_tensors(shards: _Shards, state: dict, shape: ModelShape, dtype) -> None:
    """One group of checkpoint model tensors into `shards` by their Hugging Face names: a tied head left out
    (transformers re-ties it), vocabulary rows padded for TP cut, stacked experts split per expert."""
    for k in sorted(state):
        ours = k[len("model.") :]
        if shape.tied_embeddings and ours == "output.weight":
            continue
        t = state[k]
        if ours in ("tok_embeddings.weight", "output.weight"):
            t = t[: shape.vocab]
        t = t.to(dtype).contiguous()
        per_expert = expert_names(ours, shape) if shape.moe else None
        parts = zip(per_expert, t) if per_expert is not None else [(to_hf(ours, shape), t)]
        shards.add([(name, part.contiguous()) for name, part in parts], t.numel() * t.element_size())


def _write_configs(folder: Path, shape: ModelShape, source_config: str | Path | None, dtype: str) -> None:
    """config.json (the source's, dtype updated, or one written from the shape) and generation_config.json (the
    source's, else the config's special token ids)."""
    source = read_config(source_config) if source_config else None
    cfg = config_for_export(shape, source, dtype)
    atomic_write_text(folder / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_src = config_path(source_config).with_name("generation_config.json") if source_config else None
    if gen_src is not None and gen_src.is_file():
        shutil.copyfile(gen_src, folder / "generation_config.json")
    else:
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        atomic_write_text(folder / "generation_config.json", json.dumps(gen, indent=2) + "\n")


def export_checkpoint(
    ckpt: Path,
    shape: ModelShape,
    out: Path,
    dtype: str = "bf16",
    source_config: str | Path | None = None,
    tokenizer: str | Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    lora: LoraSettings | None = None,
    base: str | None = None,
    chat_template: str | Path | None = None,
) -> Path:
    """Write the export of DCP checkpoint `ckpt` (a `step-N` folder) to `out`; returns `out`. A LoRA run's (`lora`)
    is the merged model there and its adapter, as PEFT writes one, in `out/adapter/`, whose base is the run's
    weights folder `base` (model.weights), or without one the unmerged base written to `out/base/` (adapter_base).
    `chat_template`: the run's model.chat_template file, exported as chat_template.jinja. Every file gets the
    usual (umask) mode: safetensors writes 0600. Without `lora.merged` (a QLoRA run's default) no merged model is
    written: `out/adapter/` (with the tokenizer) onto the 4-bit base is the export."""
    import torch
    import torch.distributed.checkpoint as dcp

    from nightloom.train.qlora import bnb_config, dequantized_state

    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r}; expected one of {', '.join(DTYPES)}")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    keys = [k for k in meta if k.startswith("model.")]
    if not keys:
        raise ValueError(f"{ckpt}: no model tensors in this checkpoint")
    base_read = _base_reader(ckpt, shape, base) if lora is not None else None  # an adapter-only checkpoint's base
    if base_read is not None:
        keys += [k for k in _base_keys(shape) if k not in meta]
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    merged = lora is None or lora.merged
    shards = {tmp: _Shards(tmp, max_shard_bytes)} if merged else {}
    if lora is not None and not base:
        shards[tmp / BASE_DIR] = _Shards(tmp / BASE_DIR, max_shard_bytes)
    adapters: dict[str, torch.Tensor] = {}
    for group in _groups(keys):
        state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in group if k in meta}
        with quiet_no_dist():  # one process on purpose
            dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
        if base_read is not None:
            state |= {k: base_read(k) for k in group if k not in meta}
        if lora is not None and lora.quant is not None:  # the base as the run computed with it, dequantized
            state = dequantized_state(state, lora.quant, shape)
        if lora is not None:
            if (unmerged := shards.get(tmp / BASE_DIR)) is not None:
                _add_tensors(unmerged, {k: v for k, v in state.items() if ".lora_" not in k}, shape, torch_dtype)
            state, found = merge_lora(state, lora.scaling, lora.dora)
            state, found, beside = merge_beside(state, found, lora, shape)
            adapters |= {"base_model.model." + to_hf(k[len("model.") :], shape): t for k, t in found.items()} | beside
        elif any(".lora_" in k for k in state):
            raise ValueError(f"{ckpt}: holds LoRA adapters but no train.lora settings were given to merge them")
        if merged:
            _add_tensors(shards[tmp], state, shape, torch_dtype)
        del state
    for folder, written in shards.items():
        written.finish()
        _write_configs(folder, shape, source_config, dtype)
        _copy_tokenizer(tokenizer, chat_template, folder)
    if lora is not None:
        write_peft_adapter(tmp / ADAPTER_DIR, adapters, lora, torch_dtype, adapter_base(base, out), shape)
        if lora.quant is not None:  # BitsAndBytesConfig.from_dict of it loads the base 4-bit, as the run held it
            quant = json.dumps(bnb_config(lora.quant), indent=2, sort_keys=True)
            atomic_write_text(tmp / ADAPTER_DIR / QUANT_CONFIG, quant + "\n")
        if not merged:  # the adapter is the export: its tokenizer beside it
            _copy_tokenizer(tokenizer, chat_template, tmp / ADAPTER_DIR)
    share_mode(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _base_reader(ckpt: Path, shape: ModelShape, base: str | None):
    """For an adapter-only checkpoint (train/adapter_ckpt.py): checkpoint key -> the base tensor from the weights
    folder `base`; None for a checkpoint that holds its base."""
    meta_file = Path(ckpt) / "meta.json"
    if not meta_file.is_file() or not json.loads(meta_file.read_text(encoding="utf-8")).get("adapters_only"):
        return None
    if not base:
        raise ValueError(f"{ckpt}: holds the adapters only; its base (the run's model.weights) is needed to export")
    from nightloom.hf.load import fetch_weights, read_tensor, scan_checkpoint

    index = scan_checkpoint(fetch_weights(base, log=lambda _: None), shape)
    return lambda key: read_tensor(index, to_hf(key[len("model.") :], shape))


def _base_keys(shape: ModelShape) -> list[str]:
    """Checkpoint keys of the model's parameters (a tied head left out)."""
    from nightloom.train.model import build_model

    names = [n for n, _ in build_model(shape, device="meta").named_parameters()]
    return ["model." + n for n in names if not (shape.tied_embeddings and n == "output.weight")]


def merge_lora(state: dict, scaling: float, dora: bool = False) -> tuple[dict, dict]:
    """(base tensors with W + scaling · B A merged in fp32, the adapters' tensors) of one group of checkpoint keys.
    DoRA (train/lora.py): the merged rows are m / ||W + s B A||_c · (W + s B A), and the adapter's magnitude is
    m = ||W||_c + the trained delta, under PEFT's name `lora_magnitude_vector`."""
    import torch

    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    merged = {k: v for k, v in state.items() if ".lora_" not in k}
    for k in [k for k in adapters if k.endswith(".lora_A.weight")]:
        stem = k[: -len(".lora_A.weight")]
        a, b = adapters[k].float(), adapters[f"{stem}.lora_B.weight"].float()
        w = merged[f"{stem}.weight"]
        new = w.float() + scaling * (b @ a)
        if dora:
            m = torch.linalg.norm(w.float(), dim=1) + adapters.pop(f"{stem}.lora_magnitude_delta").float()
            adapters[f"{stem}.lora_magnitude_vector"] = m
            new = (m / torch.linalg.norm(new, dim=1)).unsqueeze(1) * new
        merged[f"{stem}.weight"] = new.to(w.dtype)
    return merged, adapters


def merge_beside(state: dict, found: dict, lora: LoraSettings, shape: ModelShape) -> tuple[dict, dict, dict]:
    """(state, adapters, PEFT tensors) with what trained beside the adapters (train/lora.train_beside) taken out of
    one group: token rows merged into the embedding and written as PEFT's TrainableTokens values (base row +
    delta: `...embed_tokens.token_adapter.trainable_tokens_delta`); a saved module written whole under its
    Hugging Face name (`base_model.model.lm_head.weight`, as PEFT saves modules_to_save), a tied one under both."""
    import torch

    emb, head = "model.tok_embeddings.weight", "model.output.weight"
    peft: dict = {}
    delta = found.pop("model.tok_embeddings.lora_tokens_delta", None)
    if delta is not None:
        w, idx = state[emb], torch.tensor(lora.tokens)
        rows = w[idx].float() + delta.float()
        state = state | {emb: w.index_copy(0, idx, rows.to(w.dtype))}
        peft["base_model.model." + _hf_stem(emb, shape) + ".token_adapter.trainable_tokens_delta"] = rows
    saved = {"embed_tokens": emb, "lm_head": head}
    for name in saved_modules(lora, shape):
        key = emb if shape.tied_embeddings else saved[name]
        if key in state:
            peft["base_model.model." + _hf_stem(saved[name], shape) + ".weight"] = state[key][: shape.vocab].clone()
    return state, found, peft


def _hf_stem(key: str, shape: ModelShape) -> str:
    """A checkpoint weight's Hugging Face module name: `model.output.weight` -> `lm_head`."""
    return to_hf(key[len("model.") :], shape)[: -len(".weight")]


def saved_modules(lora: LoraSettings, shape: ModelShape | None) -> list[str]:
    """PEFT's modules_to_save of the adapter: the spec's, or with a tied embedding both names (one matrix: PEFT
    would keep the other tied to the untrained base)."""
    if lora.saved and shape is not None and shape.tied_embeddings:
        return ["embed_tokens", "lm_head"]
    return list(lora.saved)


def write_peft_adapter(
    folder: Path, tensors: dict, lora: LoraSettings, dtype, base: str, shape: ModelShape | None = None
) -> None:
    """adapter_config.json and adapter_model.safetensors as peft's save_pretrained writes them (key names
    `base_model.model.<HF name>.lora_A.weight`), so `PeftModel.from_pretrained(base, folder)` loads them, and
    `AutoPeftModelForCausalLM.from_pretrained(folder)` too: `base` (adapter_base) is its base model's folder or id."""
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
        "use_rslora": lora.rslora,
        "use_dora": lora.dora,
        "modules_to_save": saved_modules(lora, shape) or None,
        "trainable_token_indices": list(lora.tokens) or None,
        "base_model_name_or_path": base or None,
    }
    atomic_write_text(folder / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
