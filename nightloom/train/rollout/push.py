"""The training model's weights as a Hugging Face state, one tensor at a time: what the vllm rollout engine loads
after each optimizer step (vLLM's `load_weights` takes Hugging Face names, as TRL's GRPOTrainer pushes them).

Every tensor is whole: a DTensor (FSDP2 or TP shards) is gathered with `full_tensor()`, a collective every rank
joins in the same order (each rank then holds the full tensor: the colocated engine of each rank loads it). LoRA
adapters are merged into their base (W + scaling · B A, DoRA's row norm: hf/export.merge_lora, the export's own
merge), names go through hf/names.to_hf (the export's), a tied head is left out (vLLM ties it), vocabulary rows
padded for a TP cut are dropped, stacked experts are split per expert under the Hub's names."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from nightloom.hf.export import merge_lora
from nightloom.hf.names import expert_names, to_hf
from nightloom.shape import ModelShape

#: wrappers' prefixes inside parameter names (activation checkpointing, torch.compile), not part of the model's
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
_LORA_PARTS = (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_delta")


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def _clean(name: str) -> str:
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


def _hf_tensors(name: str, t: torch.Tensor, shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """One native tensor as its Hugging Face tensors (none for a tied head)."""
    if shape.tied_embeddings and name == "output.weight":
        return []
    if name in ("tok_embeddings.weight", "output.weight"):
        t = t[: shape.vocab]
    per_expert = expert_names(name, shape) if shape.moe else None
    if per_expert is not None:
        return list(zip(per_expert, t.unbind(0), strict=True))
    return [(to_hf(name, shape), t)]


def hf_state(model: nn.Module, shape: ModelShape, dora: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, whole tensor) of every parameter of `model` (a native Transformer, LoRA merged)."""
    params = [(_clean(n), p) for n, p in model.named_parameters()]
    lora = {n[: -len(".lora_A.weight")] for n, _ in params if n.endswith(".lora_A.weight")}
    needed = 3 + dora  # a LoRA module's weight, A, B (and DoRA's magnitude) before it merges
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in params:
        t = _whole(p)  # every rank gathers every parameter, in the same order
        stem = next((name[: -len(s)] for s in (*_LORA_PARTS, ".weight") if name.endswith(s)), None)
        if stem in lora:
            held.setdefault(stem, {})[name] = t
            if len(held[stem]) < needed:
                continue
            scaling = model.get_submodule(_lora_path(model, stem)).lora_scaling
            merged, _ = merge_lora(held.pop(stem), scaling, dora)
            name, t = f"{stem}.weight", merged[f"{stem}.weight"]
        elif ".lora_" in name:
            raise ValueError(f"{name}: trained beside the adapters; the vllm engine does not take it (train.lora)")
        yield from _hf_tensors(name, t, shape)
    if held:
        raise ValueError(f"LoRA modules without all their tensors: {', '.join(sorted(held))}")
    for name, b in model.named_buffers():  # deepseek_v3's expert-choice bias is a buffer the export writes
        if _clean(name).endswith("ffn.router_bias"):
            yield to_hf(_clean(name), shape), _whole(b)


def _lora_path(model: nn.Module, stem: str) -> str:
    """The module path of a cleaned LoRA stem in `model` (wrappers' prefixes put back where the model has them)."""
    for name, _ in model.named_modules():
        if _clean(name) == stem:
            return name
    raise ValueError(f"{stem}: no such module")
