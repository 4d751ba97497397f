"""Model shapes and GPU facts: the one place the planner, trainer and validation read them from.

Model shapes are the published architectures (Llama 2: Touvron et al. 2023, Table/config.json;
Llama 3: Meta's config.json files). GPU peaks are dense (no sparsity) datasheet figures; each entry
names its source, because MFU against a wrong peak is worse than no MFU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder shape (GPT-2 style models set `gated_mlp=False`, `kv_heads=heads`)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    max_seq: int
    tied_embeddings: bool = False
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs GELU MLP (2 matrices)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    published_params: float | None = None  # parameter count as published, for checks

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"model {self.name}: hidden ({self.hidden}) is not divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads ({self.heads}) is not divisible by kv_heads ({self.kv_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def with_(self, **kw) -> ModelShape:
        return replace(self, **kw)


def _llama(name, layers, hidden, heads, kv, ffn, vocab, seq, params, theta=10000.0, eps=1e-5):
    return ModelShape(name, layers, hidden, heads, kv, ffn, vocab, seq, False, True, eps, theta, params)


MODELS: dict[str, ModelShape] = {
    # CPU-sized models (byte vocabulary) for tests, the demo and benchmarks.
    "tiny": ModelShape("tiny", 4, 64, 4, 2, 176, 256, 512, tied_embeddings=False),
    "tiny-tied": ModelShape("tiny-tied", 4, 64, 4, 2, 176, 256, 512, tied_embeddings=True),
    "small": ModelShape("small", 4, 256, 8, 4, 704, 256, 1024),
    # Published shapes.
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, 6.74e9),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, 13.02e9),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, 68.98e9),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 8.03e9, 500000.0),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 70.55e9, 500000.0),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, 405.85e9, 500000.0),
}


@dataclass(frozen=True)
class GPUSpec:
    """Facts about one accelerator type. Bandwidths are per GPU, unidirectional, in bytes/s."""

    name: str
    peak_flops_bf16: float  # dense bf16/fp16 tensor-core FLOP/s
    peak_flops_fp32: float  # dense fp32 (non-TF32) FLOP/s
    memory_gib: float
    intra_node_bw: float  # NVLink / HCCS / PCIe, bytes/s per GPU
    inter_node_bw: float  # network bytes/s per GPU
    intra_node_latency_s: float
    inter_node_latency_s: float
    source: str

    def peak(self, precision: str) -> float:
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_bf16


GB = 1e9
GPUS: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec("a100-40gb", 312e12, 19.5e12, 40, 300 * GB, 25 * GB, 5e-6, 10e-6,
                         "NVIDIA A100 datasheet (SXM, 2021): 312 TFLOPS BF16 dense, NVLink 600 GB/s bidir"),
    "a100-80gb": GPUSpec("a100-80gb", 312e12, 19.5e12, 80, 300 * GB, 25 * GB, 5e-6, 10e-6,
                         "NVIDIA A100 datasheet (SXM, 2021): 312 TFLOPS BF16 dense, NVLink 600 GB/s bidir"),
    "a800-80gb": GPUSpec("a800-80gb", 312e12, 19.5e12, 80, 200 * GB, 25 * GB, 5e-6, 10e-6,
                         "NVIDIA A800 datasheet (SXM): 312 TFLOPS BF16 dense, NVLink 400 GB/s bidir"),
    "h100-80gb": GPUSpec("h100-80gb", 989e12, 67e12, 80, 450 * GB, 50 * GB, 4e-6, 8e-6,
                         "NVIDIA H100 datasheet (SXM5): 989 TFLOPS BF16 dense, NVLink 900 GB/s bidir"),
}


def get_model(name: str) -> ModelShape:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def get_gpu(name: str) -> GPUSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise KeyError(f"unknown GPU type {name!r}; known: {', '.join(sorted(GPUS))}") from None
