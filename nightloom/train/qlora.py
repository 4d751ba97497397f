"""QLoRA (Dettmers et al. 2023): a LoRA run's frozen base linears held quantized, dequantized per forward.

`train.lora.quantize: nf4 | fp4` stores each decoder linear as bitsandbytes stores a `Linear4bit` weight: blocks of
64 consecutive weights (row-major) as 4-bit codes (two per byte) and one absmax per block; `double_quant` also
quantizes the absmaxes (their mean subtracted) in blocks of 256 to 8 bits. The forward is bitsandbytes'
`matmul_4bit`, the op PEFT + bitsandbytes runs, so step 1 equals theirs. `int8` keeps one absmax scale per row
(weight-only: the activations stay in the compute dtype, unlike bitsandbytes' LLM.int8 matmul).

Why bitsandbytes and not torchao's NF4Tensor: torchao is not in the venv, and bitsandbytes' blockwise layout
composes with FSDP2 as plain tensors: a row holds `in / 64` whole blocks, so the codes (out × in/2 bytes) and the
absmaxes (out × in/64) shard on dim 0 as the weight would, and FSDP2 all-gathers uint8 parameters untouched (its
MixedPrecisionPolicy casts floating-point parameters only; fp32 absmaxes are stored as their bytes for that
reason). The double quantization's second-level scales and offset (one float per 16,384 weights) are replicated
buffers. Each rank quantizes only its own rows of each weight; the absmax statistics of the whole matrix (for the
offset) come from the matrix each rank reads once anyway, so every layout stores the bytes one process does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

BLOCK = 64  # bitsandbytes' 4-bit block (BitsAndBytesConfig's default)
BLOCK2 = 256  # double quantization's block over the absmaxes
_LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "auto": None}


@dataclass(frozen=True)
class QuantSettings:
    """train.lora's quantization: kind (nf4, fp4, int8), double quantization, compute dtype (None: the input's)."""

    kind: str
    double_quant: bool = True
    compute_dtype: torch.dtype | None = None

    @classmethod
    def from_spec(cls, lora) -> QuantSettings | None:
        if lora is None or not getattr(lora, "quantize", None):
            return None
        return cls(lora.quantize, bool(lora.double_quant), _DTYPES[lora.compute_dtype])

    @property
    def bits(self) -> int:
        return 8 if self.kind == "int8" else 4


def _frozen(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class QuantLinear(nn.Module):
    """A frozen linear stored quantized (see the module docstring); forward = x W^T + b in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, q: QuantSettings, device=None):
        super().__init__()
        self.in_features, self.out_features, self.q = in_features, out_features, q
        if q.kind == "int8":
            self.qweight = _frozen((out_features, in_features), torch.int8, device)
            self.absmax = _frozen((out_features, 4), torch.uint8, device)  # one fp32 scale per row, as bytes
        else:
            self.qweight = _frozen((out_features, in_features // 2), torch.uint8, device)
            per_row = in_features // BLOCK
            self.absmax = _frozen((out_features, per_row if q.double_quant else 4 * per_row), torch.uint8, device)
            if q.double_quant:
                n2 = -(-out_features * per_row // BLOCK2)
                self.register_buffer("absmax2", torch.empty(n2, dtype=torch.float32, device=device))
                self.register_buffer("code2", torch.empty(256, dtype=torch.float32, device=device))
                self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=device))
        self.bias = _frozen((out_features,), torch.float32, device) if bias else None

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.q.kind}, double_quant={self.q.double_quant}"

    def quant_state(self):
        """bitsandbytes' QuantState of the (gathered) weight."""
        import bitsandbytes.functional as bf

        code = bf.get_4bit_type(self.q.kind, device=self.qweight.device)
        shape = torch.Size((self.out_features, self.in_features))
        if not self.q.double_quant:
            absmax = self.absmax.reshape(-1).view(torch.float32)
            return bf.QuantState(absmax, shape, code, BLOCK, self.q.kind, torch.float32)
        state2 = bf.QuantState(absmax=self.absmax2, code=self.code2, blocksize=BLOCK2, dtype=torch.float32)
        return bf.QuantState(
            self.absmax.reshape(-1), shape, code, BLOCK, self.q.kind, torch.float32, self.offset, state2
        )

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (out × in) as stored, in `dtype`: what merging and export read."""
        if self.q.kind == "int8":
            return (self.qweight.float() * self.absmax.view(torch.float32)).to(dtype)
        import bitsandbytes.functional as bf

        return bf.dequantize_4bit(self.qweight.reshape(-1, 1), self.quant_state()).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp = x.dtype
        cd = self.q.compute_dtype or inp
        x = x.to(cd)
        bias = None if self.bias is None else self.bias.to(cd)
        if self.q.kind == "int8":
            return nn.functional.linear(x, self.dequantized(cd), bias).to(inp)
        import bitsandbytes as bnb

        return bnb.matmul_4bit(x, self.qweight.reshape(-1, 1), quant_state=self.quant_state(), bias=bias).to(inp)

    # -- filling it -------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        """Quantize the whole weight `full` (out × in) into this rank's rows (a DTensor shard or the whole)."""
        start, stop = _rows(self.qweight)
        w = full[start:stop].float().contiguous()
        if self.q.kind == "int8":
            scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            _local(self.qweight).copy_(torch.round(w / scale).clamp(-127, 127).to(torch.int8))
            _local(self.absmax).copy_(scale.view(torch.uint8))
        else:
            self._load_4bit(full, w, start, stop)

    def _load_4bit(self, full: torch.Tensor, w: torch.Tensor, start: int, stop: int) -> None:
        import bitsandbytes.functional as bf

        packed, state = bf.quantize_4bit(w, blocksize=BLOCK, quant_type=self.q.kind)
        _local(self.qweight).copy_(packed.view(stop - start, -1))
        per_row = self.in_features // BLOCK
        if not self.q.double_quant:
            _local(self.absmax).copy_(state.absmax.view(torch.uint8).view(stop - start, -1))
            return
        # the offset is the mean over the whole matrix's blocks (bitsandbytes' compress_statistics), so every rank
        # takes the block maxima of the whole matrix (equal to bitsandbytes' absmax: tests/unit/train/test_qlora.py)
        whole = full.float().abs().reshape(-1, BLOCK).amax(1)
        offset = whole.mean()
        q2, state2 = bf.quantize_blockwise(whole - offset, blocksize=BLOCK2)
        _local(self.absmax).copy_(q2.view(self.out_features, per_row)[start:stop])
        self.absmax2.copy_(state2.absmax)
        self.code2.copy_(state2.code)
        self.offset.copy_(offset)


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _rows(p: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of the global rows this rank holds of `p` (FSDP2's dim-0 shard, or all)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return 0, p.shape[0]
    local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0], offset[0] + local[0]


def check_dims(model: nn.Module) -> None:
    """bitsandbytes' limits on every linear to quantize: `in` a multiple of 64 (whole blocks per row, so rows
    shard) and `out` a multiple of 32 (its CPU kernel); ValueError naming the module otherwise."""
    for name, lin in quantizable(model):
        if lin.in_features % BLOCK or lin.out_features % 32:
            raise ValueError(
                f"train.lora.quantize: {name} is {lin.in_features} -> {lin.out_features}; a quantized linear needs "
                f"in_features a multiple of {BLOCK} and out_features a multiple of 32"
            )


def quantizable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(native name, module) of every decoder linear the base quantizes (all but the embedding and the head, as
    transformers' bitsandbytes loader leaves them)."""
    out = []
    for key, block in getattr(model, "layers", {}).items():
        for local in _LINEARS:
            try:
                mod = block.get_submodule(local)
            except AttributeError:
                continue
            if mod is not None:
                out.append((f"layers.{key}.{local}", mod))
    return out


def quantize_base(model: nn.Module, q: QuantSettings) -> int:
    """Swap every quantizable nn.Linear of `model` (on the meta device, before LoRA and FSDP2) for an empty
    QuantLinear; `load_quantized` or `init_quantized` fills them. Returns how many."""
    if getattr(model.shape, "moe", False):
        raise ValueError("train.lora.quantize: mixture-of-experts models are not quantized yet")
    check_dims(model)
    found = quantizable(model)
    for name, lin in found:
        parent, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        ql = QuantLinear(lin.in_features, lin.out_features, lin.bias is not None, q, device=lin.weight.device)
        setattr(parent, attr, ql)
    return len(found)


def quantized_modules(model: nn.Module) -> list[tuple[str, QuantLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def is_quantized_state(name: str) -> bool:
    """A state-dict entry of a QuantLinear's storage (not a Hugging Face tensor: load_quantized fills it)."""
    return name.endswith((".qweight", ".absmax", ".absmax2", ".code2", ".offset"))


@torch.no_grad()
def init_quantized(model: nn.Module, seed: int) -> None:
    """A random base (no weights folder): each QuantLinear from the start its float weight would have had."""
    for name, mod in quantized_modules(model):
        mod.load_full(model.init_value(f"{name}.weight", (mod.out_features, mod.in_features), seed))
        if mod.bias is not None:
            _local(mod.bias).zero_()


@torch.no_grad()
def load_quantized(parts: list[nn.Module], read) -> int:
    """Every QuantLinear of `parts` from `read(native weight name)` -> the whole float tensor; returns how many."""
    n = 0
    for m in parts:
        for name, mod in quantized_modules(m):
            mod.load_full(read(f"{name}.weight"))
            n += 1
    return n


def base_bytes(model: nn.Module) -> int:
    """Bytes this rank holds of the frozen base (every parameter and buffer that does not train)."""
    seen = {id(p): p for p in model.parameters() if not p.requires_grad}
    seen |= {id(b): b for b in model.buffers()}
    return sum(_local(t).numel() * t.element_size() for t in seen.values())


def check_quantized_plan(plan) -> None:
    """A quantized base runs in one process or under FSDP2/DDP: TP and PP are refused by name."""
    if plan.tp > 1 or plan.pp > 1:
        raise ValueError(
            f"train.lora.quantize: the layout {plan.layout()} has tp {plan.tp}, pp {plan.pp}; a quantized base "
            "runs in one process or under FSDP2 (TP/PP over quantized linears are not done)"
        )


_STORAGE = (".qweight", ".absmax", ".absmax2", ".code2", ".offset")


def _quantized_stem(key: str) -> str | None:
    """`model.layers.3.attn.wq` for a quantizable linear's `.weight` or storage key, else None."""
    for suffix in (".weight", *_STORAGE):
        if key.endswith(suffix):
            stem = key[: -len(suffix)]
            if any(stem.endswith("." + lin) for lin in _LINEARS) and ".layers." in f".{stem}":
                return stem
    return None


@torch.no_grad()
def dequantized_state(state: dict, q: QuantSettings, shape) -> dict:
    """A group of checkpoint tensors with each quantized linear as the float weight the run computed with: its
    stored codes dequantized, or a float base weight (an adapter-only run's, from model.weights) quantized and
    dequantized again (`shape`: the model's ModelShape). What export merges adapters into."""
    out = {k: v for k, v in state.items() if _quantized_stem(k) is None or ".lora_" in k}
    stems = {s for k in state if ".lora_" not in k and (s := _quantized_stem(k)) is not None}
    for stem in sorted(stems):
        rows, cols = linear_shape(shape, stem.rsplit(".", 2)[-2] + "." + stem.rsplit(".", 1)[-1])
        ql = QuantLinear(cols, rows, False, q)
        if f"{stem}.weight" in state:
            ql.load_full(state[f"{stem}.weight"])
        else:
            for suffix in _STORAGE:
                if f"{stem}{suffix}" in state:
                    getattr(ql, suffix[1:]).copy_(state[f"{stem}{suffix}"])
        out[f"{stem}.weight"] = ql.dequantized(torch.float32)
    return out


def linear_shape(shape, local: str) -> tuple[int, int]:
    """(out, in) of a decoder linear by its native name in a block (`attn.wq`, ..., `ffn.w2`)."""
    q, kv, h, f = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.ffn_hidden
    dims = {"attn.wq": (q, h), "attn.wk": (kv, h), "attn.wv": (kv, h), "attn.wo": (h, q)}
    return (dims | {"ffn.w1": (f, h), "ffn.w3": (f, h), "ffn.w2": (h, f)})[local]


def bnb_config(q: QuantSettings) -> dict:
    """transformers' BitsAndBytesConfig (as its to_dict) that loads the base as the run held it, for PEFT."""
    dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32", None: "float32"}[q.compute_dtype]
    if q.kind == "int8":
        return {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}
    return {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": q.kind,
        "bnb_4bit_use_double_quant": q.double_quant,
        "bnb_4bit_compute_dtype": dtype,
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_skip_modules": ["lm_head"],
    }
