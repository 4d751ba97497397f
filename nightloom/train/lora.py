"""LoRA (Hu et al. 2021) on the native model: each targeted linear W keeps its name and its (frozen) weight and
gains two children, `lora_A` (rank x in) and `lora_B` (out x rank), whose product adds (alpha / rank) · B A x to
its output through a forward hook. The names are PEFT's (`...q_proj.lora_A.weight` once mapped by hf/names.py),
so a checkpoint's adapters export as a PEFT adapter without renaming, and the base's names do not change.

Under TP each adapter is split as its base linear is (Megatron's column/row rule applied to A and B): a column-
parallel W (q/k/v, gate/up) gets a column-parallel A whose rank outputs are all-gathered and a column-parallel B
(each rank its W's output rows); a row-parallel W (o, down) gets a row-parallel A (each rank its W's input columns)
reduce-scattered over the rank dim, and a row-parallel B whose output is reduced (or, under SP, reduce-scattered
over the sequence) exactly as W's is. So rank must be a multiple of tp. DTensor's autograd gives the adapters'
gradients the right reductions; FSDP2 then shards them with the frozen base (it only reduces what has a gradient).

DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", eq. 5; PEFT's use_dora): the adapted weight
is m · (W + s B A) / ||W + s B A||_c, the norm per output row taken as a constant (the paper's section 4.3, as PEFT
detaches it), m trained. Here m is held as ||W||_c + `lora_magnitude_delta` (trained, 0 at the start) so the start
needs no pass over the loaded base: its gradient is m's, and the export writes m itself (PEFT's
`lora_magnitude_vector`). One process and FSDP2 (whole rows in the forward); not under TP.

Dropout is drawn on the rank's local input: under TP the ranks of a row-parallel linear draw their shards' masks
from the same generator state (equal distribution, not the one-process draw); parity tests use dropout 0.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from nightloom.hf.names import to_hf
from nightloom.shape import ModelShape
from nightloom.train.qlora import QuantSettings

#: native linear -> is it column parallel under TP (else row parallel)
_COLUMN = {
    "attn.wq": True,
    "attn.wk": True,
    "attn.wv": True,
    "attn.wo": False,
    "ffn.w1": True,
    "ffn.w3": True,
    "ffn.w2": False,
}


@dataclass(frozen=True)
class LoraSettings:
    """What the trainer, the exporter and eval need of train.lora."""

    rank: int
    alpha: float
    dropout: float
    modules: tuple[str, ...]  # Hugging Face module names (q_proj, ..., down_proj)
    quant: QuantSettings | None = None  # QLoRA: the base's linears quantized (train/qlora.py)
    rslora: bool = False  # rank-stabilized: alpha / sqrt(rank)
    dora: bool = False  # weight-decomposed (DoRA): a trained magnitude per output row
    merged: bool = True  # the export writes the merged 16-bit model too (QLoRA's default: adapter only)
    saved: tuple[str, ...] = ()  # modules_to_save: embed_tokens / lm_head trained in full beside the adapters
    tokens: tuple[int, ...] = ()  # trainable_token_indices: only these embedding rows trained

    @property
    def scaling(self) -> float:
        """alpha / rank, or with rsLoRA alpha / sqrt(rank) (Kalajdzievski 2023, PEFT's use_rslora)."""
        return self.alpha / math.sqrt(self.rank) if self.rslora else self.alpha / self.rank

    @classmethod
    def from_spec(cls, lora) -> LoraSettings | None:
        """From a spec's LoraSpec (or None: full fine-tuning)."""
        if lora is None:
            return None
        quant = QuantSettings.from_spec(lora)
        rs, dora = bool(getattr(lora, "use_rslora", False)), bool(getattr(lora, "use_dora", False))
        merged = getattr(lora, "merged_export", None)
        merged = quant is None if merged is None else merged  # auto: merged for a 16-bit base only
        saved, tokens = (
            tuple(getattr(lora, "modules_to_save", None) or ()),
            getattr(lora, "trainable_token_indices", None),
        )
        args = (lora.rank, float(lora.alpha), float(lora.dropout), tuple(lora.modules()), quant, rs, dora, merged)
        return cls(*args, saved=saved, tokens=tuple(tokens or ()))


def hf_module(name: str, shape: ModelShape) -> str:
    """`layers.3.attn.wq` -> `q_proj` (the Hugging Face module name LoRA targets)."""
    return to_hf(f"{name}.weight", shape).rsplit(".", 2)[-2]


def targeted(model: nn.Module, lora: LoraSettings) -> list[tuple[str, nn.Linear, bool]]:
    """(native name, linear, column parallel?) of every linear the settings target in this model (or stage)."""
    out = []
    for key, block in getattr(model, "layers", {}).items():
        for local, column in _COLUMN.items():
            mod = block.get_submodule(local) if _has(block, local) else None
            if mod is None:
                continue
            name = f"layers.{key}.{local}"
            if hf_module(name, model.shape) in lora.modules:
                out.append((name, mod, column))
    return out


def _has(block: nn.Module, path: str) -> bool:
    try:
        return block.get_submodule(path) is not None
    except AttributeError:
        return False


def _lora_forward(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """W x (already computed, in W's output layout) + scaling · B A dropout(x)."""
    from torch.distributed.tensor import DTensor

    x = args[0]
    if isinstance(x, DTensor):  # TP's input hook made it a DTensor; the adapters' own hooks re-wrap the local part
        x = x.to_local()
    return output + module.lora_B(module.lora_A(module.lora_dropout(x))) * module.lora_scaling


def base_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A targeted linear's frozen weight (out × in) in `dtype`: dequantized when the base is quantized."""
    if hasattr(module, "dequantized"):
        return module.dequantized(dtype)
    return module.weight.to(dtype)


def dora_norm(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """||W + s B A|| of every output row (DoRA's column norm of the (in × out) weight), without gradient."""
    with torch.no_grad():
        return torch.linalg.norm(weight + scaling * (b.to(weight.dtype) @ a.to(weight.dtype)), dim=1)


def _dora_forward(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """m / ||W + s B A||_c · (W x + s B A x) + bias, m = ||W||_c + delta, as PEFT's DoraLinearVariant computes it
    (with dropout in training the base product is taken again on the dropped input, as PEFT does)."""
    x, s = args[0], module.lora_scaling
    if not s:  # adapters off (the DPO reference): the base exactly
        return output
    w = base_weight(module, output.dtype)
    a, b = module.lora_A.weight, module.lora_B.weight
    magnitude = torch.linalg.norm(w, dim=1).detach() + module.lora_magnitude_delta.to(w.dtype)
    scale = (magnitude / dora_norm(w, a, b, s)).view(*([1] * (output.dim() - 1)), -1)
    bias = getattr(module, "bias", None)
    base = output if bias is None else output - bias.to(output.dtype)
    if isinstance(module.lora_dropout, nn.Dropout) and module.training:
        x = module.lora_dropout(x)
        base = nn.functional.linear(x.to(w.dtype), w)
    lora = module.lora_B(module.lora_A(x)) * s
    return output + (scale - 1) * base + scale * lora


def apply_lora(model: nn.Module, lora: LoraSettings, tp_mesh=None, sp: bool = False) -> int:
    """Freeze `model` and give each targeted linear its adapters (on the model's device: meta before to_empty), split
    over `tp_mesh` when given (after the base's TP, before FSDP). Returns the number of adapted linears."""
    for p in model.parameters():
        p.requires_grad_(False)
    found = targeted(model, lora)
    for _, lin, column in found:
        dev = next(lin.parameters()).device  # an nn.Linear's weight, or a QuantLinear's codes
        lin.lora_A = nn.Linear(lin.in_features, lora.rank, bias=False, device=dev)
        lin.lora_B = nn.Linear(lora.rank, lin.out_features, bias=False, device=dev)
        lin.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        lin.lora_scaling = lora.scaling
        if lora.dora:
            if tp_mesh is not None and tp_mesh.size() > 1:
                raise ValueError("train.lora.use_dora: DoRA runs in one process or under FSDP2, not under TP")
            lin.lora_magnitude_delta = nn.Parameter(torch.zeros(lin.out_features, device=dev))
        if tp_mesh is not None:
            _split(lin, column, tp_mesh, sp)
        lin.register_forward_hook(_dora_forward if lora.dora else _lora_forward)
    train_beside(model, lora, tp_mesh)
    return len(found)


def train_beside(model: nn.Module, lora: LoraSettings, tp_mesh=None) -> None:
    """What trains beside the adapters (PEFT's modules_to_save and trainable_token_indices): a saved module's weight
    unfrozen (a tied embedding is the head too), and for token rows a `lora_tokens_delta` (rows × hidden, 0 at the
    start) added to the embedding's output where the input is one of those ids. PEFT holds the rows' values
    (TrainableTokensLayer's trainable_tokens_delta); a delta has the same gradient and starts without reading
    the loaded base, and the export writes base row + delta under PEFT's name. A pipeline stage without the
    module has nothing to do."""
    tied = model.shape.tied_embeddings  # one matrix: a pipeline's last stage holds the head's copy of it
    for name in lora.saved:
        for attr in (
            ("tok_embeddings", "output") if tied else ("tok_embeddings" if name == "embed_tokens" else "output",)
        ):
            if (mod := getattr(model, attr, None)) is not None:
                mod.weight.requires_grad_(True)
    emb = getattr(model, "tok_embeddings", None)
    if not lora.tokens or emb is None:
        return
    shape = model.shape
    where = "train.lora.trainable_token_indices"
    if shape.tied_embeddings:
        raise ValueError(f"{where}: {shape.name} ties its head to the embedding; use modules_to_save: [embed_tokens]")
    if tp_mesh is not None and tp_mesh.size() > 1:
        raise ValueError(f"{where}: the rows train in one process or under FSDP2, not under TP")
    if max(lora.tokens) >= shape.vocab:
        raise ValueError(f"{where}: id {max(lora.tokens)} is not below {shape.name}'s vocabulary ({shape.vocab})")
    emb.lora_tokens_delta = nn.Parameter(torch.zeros(len(lora.tokens), shape.hidden, device=emb.weight.device))
    emb.lora_token_ids, emb.lora_scaling = lora.tokens, 1.0  # scaling 0: the base rows (adapters_disabled)
    emb.register_forward_hook(_tokens_forward)


def _tokens_forward(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The embedding's rows of the trained ids + their deltas: a one-hot (…, rows) product, so only they move."""
    if not module.lora_scaling:
        return output
    ids = torch.tensor(module.lora_token_ids, device=args[0].device)
    hit = (args[0].unsqueeze(-1) == ids).to(output.dtype)
    return output + hit @ module.lora_tokens_delta.to(output.dtype)


def _split(lin: nn.Module, column: bool, tp_mesh, sp: bool) -> None:
    """Shard A and B over the TP mesh as the base linear is (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tp_mesh.size() > 1 and lin.lora_A.out_features % tp_mesh.size():
        raise ValueError(f"train.lora.rank {lin.lora_A.out_features} is not a multiple of tp {tp_mesh.size()}")
    if column:
        plan = {"lora_A": ColwiseParallel(output_layouts=Replicate()), "lora_B": ColwiseParallel()}
    else:
        seq = Shard(1) if sp else Replicate()
        plan = {
            "lora_A": RowwiseParallel(output_layouts=Shard(2)),
            "lora_B": RowwiseParallel(input_layouts=Shard(2), output_layouts=seq),
        }
    parallelize_module(lin, tp_mesh, plan)


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """PEFT's default start: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform with a = sqrt(5)), B = 0, so training
    starts from the base model exactly. Drawn per parameter from (seed, name): the same in any layout."""
    from nightloom.train.model import copy_global

    for name, p in model.named_parameters():
        if name.endswith(("lora_B.weight", "lora_magnitude_delta", "lora_tokens_delta")):
            p.zero_()
        elif name.endswith("lora_A.weight"):
            g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1.0 / math.sqrt(p.shape[1])
            full = (torch.rand(p.shape, generator=g, dtype=torch.float32) * 2 - 1) * bound
            copy_global(p, full.to(p.dtype))


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer steps: every one, or with LoRA the adapters and what trains beside them."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_parameters(shape: ModelShape, lora: LoraSettings) -> int:
    """Trainable parameters of the adapters on the whole model: rank · (in + out) per targeted linear."""
    h, q, kv, f = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn_hidden
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    dims |= {"gate_proj": (h, f), "up_proj": (h, f) if shape.gated_mlp else None, "down_proj": (f, h)}
    per_layer = sum(lora.rank * sum(d) for m, d in dims.items() if d is not None and m in lora.modules)
    return per_layer * shape.layers
