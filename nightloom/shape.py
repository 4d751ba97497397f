"""ModelShape: the one resolved record of a model's architecture that the planner, trainer, exporter, eval and
cost all read. Built once per run by `nightloom.model_resolver` (from the catalog or a Hugging Face config);
a new model family adds its fields here, its parsing to `nightloom/hf/config.py`, and nothing else reads shapes
another way. A stdlib dataclass, so pydantic records (TrainJob) carry it as it is, with no mirror to keep in step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of a Hugging Face config (`rope_scaling` / `rope_parameters`).

    kind "linear": every inverse frequency / factor (Chen et al. 2023, position interpolation);
    kind "llama3": Meta's Llama 3.1 wavelength-dependent rule (transformers `_compute_llama3_parameters`)."""

    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder shape (GPT-2 style models set `gated_mlp=False`, `kv_heads=heads`).

    The fields after `published_params` carry what a Hugging Face llama/mistral/qwen2/qwen3 config.json may
    change in the math (nightloom/hf/config.py fills them); their defaults are the plain Llama decoder."""

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
    explicit_head_dim: int | None = None  # config.json `head_dim` when it is not hidden // heads
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # q/k/v projections carry a bias (qwen2; llama/qwen3 attention_bias)
    o_bias: bool = False  # output projection carries a bias (llama/qwen3 attention_bias)
    mlp_bias: bool = False  # gate/up/down carry a bias (llama mlp_bias)
    sliding_window: int | None = None  # attention window (mistral); training seq_len must not exceed it
    qk_norm: bool = False  # per-head RMSNorm (weights of size head_dim) on q and k before RoPE (qwen3)
    padded_vocab: int = 0  # embedding/head rows when padded for TP (> vocab); logits are cut back to vocab
    arch: str = "llama"  # Hugging Face model_type written on export

    def __post_init__(self) -> None:
        if self.explicit_head_dim is None and self.hidden % self.heads:
            raise ValueError(f"model {self.name}: hidden ({self.hidden}) is not divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads ({self.heads}) is not divisible by kv_heads ({self.kv_heads})")
        if self.padded_vocab and self.padded_vocab < self.vocab:
            raise ValueError(f"model {self.name}: padded_vocab ({self.padded_vocab}) < vocab ({self.vocab})")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    @property
    def embed_rows(self) -> int:
        """Rows of the embedding and output matrices (the vocabulary, padded for TP when asked)."""
        return max(self.vocab, self.padded_vocab)

    def padded_for_tp(self, tp: int) -> ModelShape:
        """The same model with its embedding rows rounded up to a multiple of `tp` (Megatron pads the same way)."""
        rows = -(-self.vocab // tp) * tp
        return replace(self, padded_vocab=rows if rows != self.vocab else 0)

    def with_(self, **kw) -> ModelShape:
        return replace(self, **kw)
