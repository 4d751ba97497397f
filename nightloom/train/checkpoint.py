"""DCP checkpoints under `<checkpoint_dir>/step-N`, written to a temp name and renamed after a barrier.

A `latest` pointer file (written last, atomically) names the newest complete checkpoint. State is keyed by
global parameter names (flattened optimizer state too), so any layout can load what any other saved.
A tied embedding is stored once, under the embedding's name: a pipeline's last stage writes and reads its head
copy under that name (identical to the first stage's, train/tied.py), and one process or TP never writes the head.
The step number is the only other state: data and learning rate are pure functions of it.
A LoRA run over a base outside the checkpoint (model.weights) writes its adapters only (`adapters_only` in
meta.json, with the base's fingerprint, checked on resume: train/adapter_ckpt.py), with what trains beside them
(modules_to_save, token rows: `adapter_state`); the frozen base is loaded again.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from nightloom.train.tied import EMBED_NAME, HEAD_NAME, head_only
from nightloom.util import atomic_write_text, quiet_no_dist

LATEST = "latest"
_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def _renamed(state: dict, old: str, new: str) -> dict:
    """Model (`name`) and flattened optimizer (`state.name.x`, `param_groups.name.x`) keys of `old` as `new`."""
    out = {}
    for k, v in state.items():
        for prefix in ("", "state.", "param_groups."):
            if k == prefix + old or k.startswith(prefix + old + "."):
                k = prefix + new + k[len(prefix + old) :]
                break
        out[k] = v
    return out


def _stored(m: nn.Module, model: dict, optim: dict) -> tuple[dict, dict]:
    """A part's state under the checkpoint's names: a tied head is stored as the embedding (once)."""
    if not getattr(getattr(m, "shape", None), "tied_embeddings", False):
        return model, optim
    if head_only(m):  # the last pipeline stage's copy
        return _renamed(model, HEAD_NAME, EMBED_NAME), _renamed(optim, HEAD_NAME, EMBED_NAME)
    model.pop(HEAD_NAME, None)  # the same parameter as the embedding (the optimizer names it once already)
    return model, optim


def adapter_state(m: nn.Module, state: dict) -> dict:
    """What an adapter-only checkpoint keeps of a part's model state: the LoRA tensors (`.lora_`: adapters, DoRA's
    magnitudes, token rows) and every other trained parameter (train.lora.modules_to_save), never the frozen base."""
    trained = {
        n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        for n, p in m.named_parameters()
        if p.requires_grad
    }
    return {k: v for k, v in state.items() if ".lora_" in k or k in trained}


def _state(parts: list[nn.Module], optims: list, adapters_only: bool = False) -> dict:
    model, optim = {}, {}
    for m, o in zip(parts, optims):
        msd = get_model_state_dict(m)
        msd, osd = _stored(
            m, adapter_state(m, msd) if adapters_only else msd, get_optimizer_state_dict(m, o, options=_OPTS)
        )
        model.update(msd)
        optim.update(osd)
    return {"model": model, "optim": optim}


def _prepare(ckpt_dir: Path, step: int, rank: int) -> tuple[Path, Path]:
    """(temp path, final path) of step `step`, the temp one emptied by rank 0 before any rank writes."""
    final, tmp = ckpt_dir / f"step-{step}", ckpt_dir / f".tmp-step-{step}"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save interrupted earlier
    dist.barrier()
    return tmp, final


def _publish(ckpt_dir: Path, step: int, tmp: Path, final: Path, extra: dict | None = None) -> None:
    """Rank 0, once every rank's shards and DCP's .metadata are written: meta.json, the rename, `latest` last."""
    meta = {"step": step, "time": time.time(), **(extra or {})}
    atomic_write_text(tmp / "meta.json", json.dumps(meta) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(ckpt_dir / LATEST, final.name + "\n")


def save(
    ckpt_dir: Path, step: int, parts: list[nn.Module], optims: list, rank: int, extra: dict | None = None
) -> tuple[Path, float]:
    """Collective: every rank writes its shards; returns (final path, seconds). `extra` goes into meta.json; with
    `adapters_only` set there, only the LoRA adapters of the model are written."""
    t0 = time.perf_counter()
    tmp, final = _prepare(ckpt_dir, step, rank)
    dcp.save(_state(parts, optims, bool((extra or {}).get("adapters_only"))), checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        _publish(ckpt_dir, step, tmp, final, extra)
    dist.barrier()
    return final, time.perf_counter() - t0


class AsyncSaver:
    """train.async_checkpoint: `dcp.async_save` copies the state to host memory, then a thread writes it over a
    gloo group of its own (collectives of two threads never share a group) while training goes on. DCP's
    coordinator (rank 0) gathers every rank's write results before its future completes, so rank 0 alone then
    publishes (meta.json, rename, `latest` last); one save is in flight at a time."""

    def __init__(self, ckpt_dir: Path, rank: int, extra: dict | None = None):
        self.ckpt_dir, self.rank, self.extra = ckpt_dir, rank, extra
        self.group = dist.new_group(backend="gloo")  # collective: every rank builds it at the same point
        self.pending: tuple[object, int, Path, Path] | None = None  # (future, step, tmp, final)

    def save(self, step: int, parts: list[nn.Module], optims: list) -> tuple[Path, float]:
        """Collective: wait for the save in flight, stage this one and start writing it; (final path, seconds
        this call blocked)."""
        t0 = time.perf_counter()
        self.wait()
        tmp, final = _prepare(self.ckpt_dir, step, self.rank)
        state = _state(parts, optims, bool((self.extra or {}).get("adapters_only")))
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
        self.pending = (future, step, tmp, final)
        return final, time.perf_counter() - t0

    def poll(self) -> Path | None:
        """Publish the save in flight if it has finished (never blocks); its final path, else None."""
        if self.pending is not None and self.pending[0].done():
            return self.wait()
        return None

    def wait(self) -> Path | None:
        """Block until the save in flight is written (its error raised here), then publish it (rank 0)."""
        if self.pending is None:
            return None
        future, step, tmp, final = self.pending
        self.pending = None
        future.result()
        if self.rank == 0:
            _publish(self.ckpt_dir, step, tmp, final, self.extra)
        return final


def latest(ckpt_dir: Path) -> tuple[Path, int] | None:
    """(path, step) of the newest complete checkpoint, or None."""
    pointer = ckpt_dir / LATEST
    if not pointer.is_file():
        return None
    path = ckpt_dir / pointer.read_text(encoding="utf-8").strip()
    meta = path / "meta.json"
    if not meta.is_file():
        raise FileNotFoundError(f"{pointer}: points to {path}, which has no meta.json (incomplete checkpoint)")
    return path, int(json.loads(meta.read_text(encoding="utf-8"))["step"])


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json: step, time, and for an adapter-only one `adapters_only` and `base` ({} for a bare
    DCP folder without one: it holds whatever its writer put there)."""
    meta = Path(path) / "meta.json"
    return json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else {}


def size_bytes(path: Path) -> int:
    """Bytes of a checkpoint folder's files."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def load(path: Path, parts: list[nn.Module], optims: list) -> None:
    """Collective: load model and optimizer state into this layout (DCP reshards); an adapter-only checkpoint
    loads the adapters and leaves the base as the caller loaded it."""
    state = _state(parts, optims, bool(read_meta(path).get("adapters_only")))
    dcp.load(state, checkpoint_id=str(path))
    for m, o in zip(parts, optims):
        model, optim = state["model"], state["optim"]
        if head_only(m):  # a pipeline's last stage reads the stored embedding into its head copy
            model, optim = _renamed(model, EMBED_NAME, HEAD_NAME), _renamed(optim, EMBED_NAME, HEAD_NAME)
        set_model_state_dict(m, model, options=StateDictOptions(strict=False))
        set_optimizer_state_dict(m, o, optim, options=_OPTS)


def load_weights(path: Path, model: nn.Module) -> None:
    """One process, no process group (eval, tools): the checkpoint's model weights into a whole `model`. A tied
    head is the embedding's own parameter here, filled from the one stored matrix (the head is not stored)."""
    state = get_model_state_dict(model)
    tied = getattr(getattr(model, "shape", None), "tied_embeddings", False)
    if tied:
        state.pop(HEAD_NAME, None)
    adapters_only = bool(read_meta(path).get("adapters_only"))
    if adapters_only:  # the caller loaded the base (model.weights) already
        state = adapter_state(model, state)
    with quiet_no_dist():  # one process on purpose: torch's "torch.distributed is disabled" warning is noise here
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    set_model_state_dict(model, state, options=StateDictOptions(strict=not (tied or adapters_only)))
