"""Hugging Face safetensors weights -> this rank's shards of the native model, after parallelization.

`scan_checkpoint` reads only the safetensors headers and accounts for every tensor (missing, unexpected,
wrongly shaped, truncated: a WeightsError naming the file and the tensor) before anything is loaded.
`load_hf_weights` then fills every rank's DTensor shards with torch DCP's HuggingFaceStorageReader, which
reads each rank's slice with `safe_open().get_slice()`: no rank holds the whole model. Only the embedding
and head of a vocabulary padded for TP are read whole (one tensor) and padded with zero rows.

A gemma3 image-text checkpoint (Gemma3ForConditionalGeneration) gives its text decoder, stored under
`language_model.model.` (the Hub's files) or `model.language_model.` (transformers 5's module names); its vision
tower and projector are left out, said once in the log: the run trains and exports the text decoder only.

A mixture-of-experts checkpoint's per-expert tensors (hf/names.py) are read one stacked matrix at a time: a rank
reads only the experts its shard holds (EP's experts, FSDP's rows of dim 0), stacks them and copies its slice of
the other dims into its shard, so a rank reads E/ep experts of each matrix, never the model.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nightloom.hf.names import (
    decoder_body,
    expected_shapes,
    expert_names,
    fused_expert_source,
    fused_router,
    holds_fused_experts,
    optional,
    text_name,
    to_hf,
)
from nightloom.shape import ModelShape

INDEX_NAME = "model.safetensors.index.json"


class WeightsError(ValueError):
    """A weights folder that does not hold exactly the model's tensors; the message names file and tensor."""


@dataclass(frozen=True)
class TensorEntry:
    file: str  # file name inside the folder
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class CheckpointIndex:
    """What a weights folder holds (from the headers only): the text decoder's tensors by their text-model
    Hugging Face name, the name each is stored under, and what was left out (an image-text checkpoint's vision
    tower and projector, by stored name)."""

    folder: Path
    tensors: dict[str, TensorEntry]
    stored: dict[str, str] = field(default_factory=dict)  # text-model name -> name in the files, where they differ
    left_out: dict[str, TensorEntry] = field(default_factory=dict)
    body: str = "model."  # the prefix the files keep the decoder's `model.*` tensors under
    fused_experts: bool = False  # MoE experts in transformers 5's fused names (gate_up_proj), not per expert

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def stored_name(self, name: str) -> str:
        return self.stored.get(name, name)

    def left_out_line(self) -> str | None:
        """The run log's one line on what an image-text checkpoint's load left out (None when nothing was)."""
        if not self.left_out:
            return None
        mib = sum(t.nbytes for t in self.left_out.values()) / 2**20
        return (
            f"[nightloom.hf] {self.folder}: image-text checkpoint: loading its text decoder ({self.body}*) only; "
            f"left out {len(self.left_out)} tensors ({mib:.1f} MiB) of {_groups(self.left_out)}: not trained, "
            "not exported (the export is a text-only gemma3_text model)"
        )


def _groups(names) -> str:
    """`vision_tower.* (10), multi_modal_projector.* (2)`: tensor counts by their first name part(s)."""
    counts = Counter(".".join(n.split(".")[: 2 if n.startswith("model.") else 1]) + ".*" for n in names)
    return ", ".join(f"{k} ({v})" for k, v in sorted(counts.items()))


def read_header(path: Path) -> dict:
    """The JSON header of one .safetensors file, checked against the file's size (truncation names the tensor)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise WeightsError(f"{path}: truncated: {size} bytes, no safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise WeightsError(f"{path}: truncated: header of {n} bytes, file of {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise WeightsError(f"{path}: not a safetensors file (bad header: {err})") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, info in header.items():
        end = info["data_offsets"][1]
        if end > data:
            raise WeightsError(f"{path}: tensor {name}: truncated (needs {end} data bytes, the file holds {data})")
    return header


def scan_checkpoint(folder: str | Path, shape: ModelShape) -> CheckpointIndex:
    """Every tensor of the folder accounted for against the model, from the headers only."""
    root = Path(folder)
    if not root.is_dir():
        raise WeightsError(f"{root}: weights folder not found")
    files = sorted(p for p in root.iterdir() if p.suffix == ".safetensors")
    if not files:
        raise WeightsError(f"{root}: no *.safetensors files")
    tensors: dict[str, TensorEntry] = {}
    for p in files:
        for name, info in read_header(p).items():
            if name in tensors:
                raise WeightsError(f"{p}: tensor {name}: also in {tensors[name].file}")
            start, end = info["data_offsets"]
            tensors[name] = TensorEntry(p.name, tuple(info["shape"]), info["dtype"], end - start)
    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise WeightsError(f"{index}: not a safetensors index ({err})") from None
        for name, file in weight_map.items():
            if name not in tensors:
                raise WeightsError(f"{index}: tensor {name}: listed in {file}, which does not hold it")
            if tensors[name].file != file:
                raise WeightsError(f"{index}: tensor {name}: listed in {file}, found in {tensors[name].file}")
        stray = sorted({t.file for t in tensors.values()} - set(weight_map.values()))
        if stray:
            raise WeightsError(f"{root / stray[0]}: not listed in {INDEX_NAME} (a stray file would be mixed in)")
    body, tensors, stored, left_out = _text_decoder(root, tensors, shape)

    def in_files(name: str) -> str:  # the name a message gives: as the files store it, or would
        return stored.get(name) or (body + name.removeprefix("model.") if name.startswith("model.") else name)

    fused = shape.moe and holds_fused_experts(tensors)
    want = expected_shapes(shape, fused)
    for name, shp in want.items():
        if name not in tensors:
            raise WeightsError(f"{root}: tensor {in_files(name)}: missing (model {shape.name} needs {list(shp)})")
        got = tensors[name]
        if got.shape != shp:
            raise WeightsError(
                f"{root / got.file}: tensor {in_files(name)}: shape {list(got.shape)}, model needs {list(shp)}"
            )
    extra = sorted(set(tensors) - set(want) - optional(shape))
    if extra:
        raise WeightsError(
            f"{root / tensors[extra[0]].file}: tensor {in_files(extra[0])}: unexpected (not in model {shape.name})"
        )
    return CheckpointIndex(root, tensors, stored, left_out, body, fused)


def _text_decoder(root: Path, tensors: dict[str, TensorEntry], shape: ModelShape):
    """(the prefix the decoder is stored under, its tensors by text-model name, their stored names where they
    differ, the left-out tensors): a text checkpoint as it is; an image-text one's decoder without its vision
    tower and projector. A checkpoint with no decoder tensor at all is refused naming what it holds."""
    try:
        body = decoder_body(list(tensors))
    except ValueError as err:
        raise WeightsError(f"{root}: {err}") from None
    ours, stored, left_out = {}, {}, {}
    for name, entry in tensors.items():
        text = text_name(name, body)
        if text is None:
            left_out[name] = entry
            continue
        if text in ours:
            raise WeightsError(f"{root / entry.file}: tensor {name}: the same decoder tensor as {stored[text]}")
        ours[text], stored[text] = entry, name
    if not set(ours) & set(expected_shapes(shape)):
        raise WeightsError(
            f"{root}: holds no text decoder for model {shape.name} (model.*, or an image-text checkpoint's "
            f"language_model.model.* or model.language_model.*): found {len(tensors)} tensors: {_groups(tensors)}"
        )
    return body, ours, {k: v for k, v in stored.items() if k != v}, left_out


def fetch_weights(uri: str, s3=None, cache_root: Path | None = None, log=print) -> Path:
    """A local folder for `uri`: itself, or an s3:// prefix in this machine's model cache (nightloom.model_cache:
    content-keyed, locked, checked against the objects, stamped last; the folder XTuner uses for the same model).
    `s3` is the job's storage.S3Config (None = the environment's endpoint)."""
    from nightloom import storage
    from nightloom.model_cache import ModelFetchError, fetch_model

    if not storage.is_s3(uri):
        return Path(uri)

    def needs_safetensors(names: list[str]) -> None:
        if not any(n.endswith(".safetensors") and "/" not in n for n in names):
            raise WeightsError(f"model.weights: {uri}: no *.safetensors objects under this prefix")

    try:
        return Path(fetch_model(uri, cache_root, s3, check_names=needs_safetensors, log=log).path)
    except ModelFetchError as e:
        raise WeightsError(str(e)) from None


def load_hf_weights(
    parts: list, folder: str | Path, shape: ModelShape, log: Callable[[str], None] | None = None
) -> CheckpointIndex:
    """Collective (every rank, once): fill each part's parameters (DTensor shards or plain tensors) from the
    folder. `shape` is the built model's shape (padded_vocab set when the vocabulary was padded for TP). What an
    image-text checkpoint's load leaves out goes to `log` once (default: printed by rank 0)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from nightloom.train.model import copy_global
    from nightloom.train.qlora import is_quantized_state, load_quantized

    index = scan_checkpoint(folder, shape)
    line = index.left_out_line()
    if line is not None:
        (log or _rank0_print)(line)
    states = [get_model_state_dict(m) for m in parts]
    to_read: dict[str, object] = {}
    padded: list[tuple[str, object]] = []
    stacked: list[tuple[list[str], object]] = []  # MoE experts: (per-expert names, the stacked tensor)
    for sd in states:
        for name, t in sd.items():
            if shape.tied_embeddings and name == "output.weight":
                continue  # the same tensor as the embedding
            if ".lora_" in name:
                continue  # LoRA adapters (train/lora.py) start from their own init, not from the base checkpoint
            if is_quantized_state(name):
                continue  # a QLoRA base's codes: quantized below from the whole tensor (train/qlora.py)
            per_expert = expert_names(name, shape) if shape.moe else None
            if per_expert is not None:
                stacked.append((per_expert, t) if not index.fused_experts else (fused_expert_source(name, shape), t))
                continue
            fused_gate = index.fused_experts and name.endswith(".ffn.router.weight")
            hf = fused_router(name) if fused_gate else to_hf(name, shape)
            if shape.embed_rows != shape.vocab and name in ("tok_embeddings.weight", "output.weight"):
                padded.append((hf, t))
            else:
                to_read[index.stored_name(hf)] = t
    dcp.load(to_read, storage_reader=HuggingFaceStorageReader(str(index.folder)))
    with torch.no_grad():
        for hf, t in padded:
            with safe_open(str(index.folder / index.tensors[hf].file), framework="pt") as f:
                full = f.get_tensor(index.stored_name(hf))
            rows = torch.zeros((shape.embed_rows - shape.vocab, full.shape[1]), dtype=full.dtype)
            copy_global(t, torch.cat([full, rows]).to(t.dtype))
        for source, t in stacked:
            _load_experts(index, source, t)
    load_quantized(parts, lambda name: read_tensor(index, to_hf(name, shape)))
    return index  # the state dicts share storage with the parameters: filled in place


def _load_experts(index: CheckpointIndex, source, t) -> None:
    """One stacked expert matrix (E, ...) into `t`: a DTensor shard (EP's experts, FSDP's rows) reads only the
    experts it holds and copies its slice of each; anything else takes the whole stack. `source`: the per-expert
    names (the Hub's layout), or (name, half) in transformers 5's fused layout (gate/up rows of gate_up_proj)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from nightloom.train.model import copy_global

    def experts(first: int, count: int):
        if isinstance(source, list):  # the Hub's layout: one tensor per expert
            return torch.stack([read_tensor(index, n) for n in source[first : first + count]])
        name, half = source
        full = read_tensor(index, name)[first : first + count]
        return full if half is None else full.chunk(2, dim=1)[half]

    if isinstance(t, DTensor) and all(type(p) is Shard or p.is_replicate() for p in t.placements):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if not shape[0]:
            return  # more FSDP ranks than experts: this shard is empty
        local = experts(offset[0], shape[0])
        for dim in range(1, local.dim()):
            local = local.narrow(dim, offset[dim], shape[dim])
        with torch.no_grad():
            t.to_local().copy_(local.to(t.dtype))
        return
    with torch.no_grad():
        copy_global(t, experts(0, t.shape[0]).to(t.dtype).contiguous())


def read_tensor(index: CheckpointIndex, name: str):
    """One tensor of the folder, whole (an MoE expert's matrix)."""
    from safetensors import safe_open

    with safe_open(str(index.folder / index.tensors[name].file), framework="pt") as f:
        return f.get_tensor(index.stored_name(name))


def _rank0_print(line: str) -> None:
    """The run log's line from rank 0 only (every process when no process group is up)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def model_from_hf(
    folder: str | Path, seq_len: int, config: str | Path | None = None, log: Callable[[str], None] | None = None
):
    """One process, no parallelism: the native model built from a Hugging Face folder's config and weights
    (tests, generation checks and single-process tools)."""
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.train.model import build_model

    shape = shape_from_hf_config(config or folder)
    model = build_model(shape, seq_len, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(0)  # rope tables; every parameter is then overwritten
    load_hf_weights([model], folder, shape, log)
    return model
