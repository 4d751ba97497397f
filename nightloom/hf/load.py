"""Hugging Face safetensors weights -> this rank's shards of the native model, after parallelization.

`scan_checkpoint` reads only the safetensors headers and accounts for every tensor (missing, unexpected,
wrongly shaped, truncated: a WeightsError naming the file and the tensor) before anything is loaded.
`load_hf_weights` then fills every rank's DTensor shards with torch DCP's HuggingFaceStorageReader, which
reads each rank's slice with `safe_open().get_slice()`: no rank holds the whole model. Only the embedding
and head of a vocabulary padded for TP are read whole (one tensor) and padded with zero rows.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from nightloom.hf.names import VISION_PREFIXES, expected_shapes, optional, to_hf
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
    """What a weights folder holds: tensor name -> where and what (from the headers only)."""

    folder: Path
    tensors: dict[str, TensorEntry]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


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
    _refuse_image_text(root, tensors)
    want = expected_shapes(shape)
    for name, shp in want.items():
        if name not in tensors:
            raise WeightsError(f"{root}: tensor {name}: missing (model {shape.name} needs {list(shp)})")
        got = tensors[name]
        if got.shape != shp:
            raise WeightsError(f"{root / got.file}: tensor {name}: shape {list(got.shape)}, model needs {list(shp)}")
    extra = sorted(set(tensors) - set(want) - optional(shape))
    if extra:
        raise WeightsError(
            f"{root / tensors[extra[0]].file}: tensor {extra[0]}: unexpected (not in model {shape.name})"
        )
    return CheckpointIndex(root, tensors)


def _refuse_image_text(root: Path, tensors: dict[str, TensorEntry]) -> None:
    """A gemma3 image-text checkpoint (vision tower, projector, the decoder under `language_model`): refused by
    the first such tensor's name; the native trainer trains a text decoder saved as gemma3_text."""
    prefixes = (*VISION_PREFIXES, "model.language_model.", "language_model.")
    found = sorted((n for n in tensors if n.startswith(prefixes)), key=lambda n: (not n.startswith(VISION_PREFIXES), n))
    if found:
        part = "vision tower" if found[0].startswith(VISION_PREFIXES) else "image-text layout"
        raise WeightsError(
            f"{root / tensors[found[0]].file}: tensor {found[0]}: the {part} of an image-text (gemma3) checkpoint is "
            "not supported: nightloom trains a text decoder only (a gemma3_text checkpoint, Gemma3ForCausalLM)"
        )


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


def load_hf_weights(parts: list, folder: str | Path, shape: ModelShape) -> CheckpointIndex:
    """Collective (every rank, once): fill each part's parameters (DTensor shards or plain tensors) from the
    folder. `shape` is the built model's shape (padded_vocab set when the vocabulary was padded for TP)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from nightloom.train.model import _copy_global

    index = scan_checkpoint(folder, shape)
    states = [get_model_state_dict(m) for m in parts]
    to_read: dict[str, object] = {}
    padded: list[tuple[str, object]] = []
    for sd in states:
        for name, t in sd.items():
            if shape.tied_embeddings and name == "output.weight":
                continue  # the same tensor as the embedding
            hf = to_hf(name, shape)
            if shape.embed_rows != shape.vocab and name in ("tok_embeddings.weight", "output.weight"):
                padded.append((hf, t))
            else:
                to_read[hf] = t
    dcp.load(to_read, storage_reader=HuggingFaceStorageReader(str(index.folder)))
    with torch.no_grad():
        for hf, t in padded:
            with safe_open(str(index.folder / index.tensors[hf].file), framework="pt") as f:
                full = f.get_tensor(hf)
            rows = torch.zeros((shape.embed_rows - shape.vocab, full.shape[1]), dtype=full.dtype)
            _copy_global(t, torch.cat([full, rows]).to(t.dtype))
    return index  # the state dicts share storage with the parameters: filled in place


def model_from_hf(folder: str | Path, seq_len: int, config: str | Path | None = None):
    """One process, no parallelism: the native model built from a Hugging Face folder's config and weights
    (tests, generation checks and single-process tools)."""
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.train.model import build_model

    shape = shape_from_hf_config(config or folder)
    model = build_model(shape, seq_len, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(0)  # rope tables; every parameter is then overwritten
    load_hf_weights([model], folder, shape)
    return model
