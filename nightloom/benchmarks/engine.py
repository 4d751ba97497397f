"""Which lm-eval backend scores a model on this node, and its `model_args`: the HF backend on one device; the HF
backend spread over the node's GPUs (`parallelize=True`: accelerate's device map, layer by layer) when the weights
pass one GPU; or the vLLM backend, tensor parallel over as many GPUs as the weights need. Decided in the lm-eval
process on the node from what it finds there (its GPUs' memory, whether vLLM is installed), the model's size and
heads, and `validate.benchmarks.backend`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from nightloom.records import FrozenRecord

#: the share of a GPU's memory the weights may fill: the rest holds activations, vLLM's KV cache, CUDA's context
HEADROOM = 0.8


class EngineError(ValueError):
    """The backend asked for cannot run here (vLLM without a GPU or without the vllm package)."""


class Engine(FrozenRecord):
    """lm-eval's model type and where the model goes: one device, spread over the GPUs, or vLLM's TP degree."""

    backend: Literal["hf", "vllm"]
    device: str | None = None  # hf on one device
    parallelize: bool = False  # hf over every GPU of the node
    tensor_parallel: int = 1  # vllm
    dtype: str = "auto"
    why: str = ""

    def model_args(self, model_dir: str, tokenizer: str | None) -> dict:
        """lm-eval's `model_args` for this engine (HFLM's or VLLM's keyword arguments)."""
        args: dict = {"pretrained": model_dir, "dtype": self.dtype}
        if self.backend == "vllm":
            args |= {"tensor_parallel_size": self.tensor_parallel, "gpu_memory_utilization": HEADROOM}
        elif self.parallelize:
            args["parallelize"] = True
        else:
            args["device"] = self.device
        return args | ({"tokenizer": tokenizer} if tokenizer else {})


def tensor_parallel(weights_bytes: int, gpu_bytes: list[int], heads: int) -> int:
    """vLLM's TP degree: the fewest GPUs (a power of two dividing the attention heads, as vLLM requires) whose
    memory holds the weights with headroom; the most such GPUs when none does (vLLM then says what is short)."""
    sizes = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= len(gpu_bytes) and heads % t == 0]
    for t in sizes:
        if weights_bytes / t <= HEADROOM * min(gpu_bytes):
            return t
    return sizes[-1]


def choose_engine(
    requested: Literal["auto", "hf", "vllm"],
    weights_bytes: int,
    gpu_bytes: list[int],
    heads: int,
    vllm_installed: bool,
) -> Engine:
    """`hf`: the HF backend (one device, or spread when the weights pass HEADROOM of the smallest of several
    GPUs); `vllm`: the vLLM backend (EngineError without a GPU or the package); `auto`: vLLM where it is installed
    and there is a GPU, else the HF backend. On the CPU, float32 (bf16 matmuls are slow there); on GPUs the
    checkpoint's dtype."""
    if requested == "vllm" and not gpu_bytes:
        raise EngineError("validate.benchmarks.backend: vllm needs a CUDA GPU on the node; none found")
    if requested == "vllm" and not vllm_installed:
        raise EngineError(
            "validate.benchmarks.backend: vllm is not installed in the node's Python environment "
            "(pip install 'lm-eval[vllm]' there, or use backend: hf)"
        )
    if not gpu_bytes:
        return Engine(backend="hf", device="cpu", dtype="float32", why="no GPU")
    gib = weights_bytes / (1 << 30)
    if requested == "vllm" or (requested == "auto" and vllm_installed):
        tp = tensor_parallel(weights_bytes, gpu_bytes, heads)
        return Engine(
            backend="vllm", tensor_parallel=tp, why=f"{gib:.1f} GiB of weights on {tp} of {len(gpu_bytes)} GPUs"
        )
    if len(gpu_bytes) > 1 and weights_bytes > HEADROOM * min(gpu_bytes):
        why = f"{gib:.1f} GiB of weights pass {HEADROOM:.0%} of one GPU: spread over {len(gpu_bytes)}"
        return Engine(backend="hf", parallelize=True, why=why)
    return Engine(backend="hf", device="cuda", why=f"{gib:.1f} GiB of weights on one GPU")


def weights_bytes(model_dir: str | Path) -> int:
    """The size of a Hugging Face folder's weights (safetensors, else PyTorch .bin files)."""
    d = Path(model_dir)
    return sum(p.stat().st_size for p in d.glob("*.safetensors")) or sum(p.stat().st_size for p in d.glob("*.bin"))


def attention_heads(model_dir: str | Path) -> int:
    """config.json's attention heads (a multimodal config's text_config's); 1 when it names none."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg) if "num_attention_heads" not in cfg else cfg
    return int(cfg.get("num_attention_heads") or 1)


def node_engine(model_dir: str, requested: Literal["auto", "hf", "vllm"] = "auto") -> Engine:
    """The engine for a model folder on this node: its GPUs as torch sees them, vLLM if importable."""
    from importlib.util import find_spec

    import torch

    gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    return choose_engine(
        requested, weights_bytes(model_dir), gpus, attention_heads(model_dir), find_spec("vllm") is not None
    )
