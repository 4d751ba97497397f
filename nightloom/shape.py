"""ModelShape: the one resolved record of a model's architecture that the planner, trainer, exporter, eval and
cost all read. Built once per run by `nightloom.model_resolver` (from the catalog or a Hugging Face config);
a new model family adds its fields here, its parsing to `nightloom/hf/config.py`, and nothing else reads shapes
another way. A stdlib dataclass, so pydantic records (TrainJob) carry it as it is, with no mirror to keep in step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face `layer_types` values the model computes
MLP_ACTS = ("silu", "gelu_tanh")
ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of a Hugging Face config (`rope_scaling` / `rope_parameters`).

    kind "linear": every inverse frequency / factor (Chen et al. 2023, position interpolation);
    kind "llama3": Meta's Llama 3.1 wavelength-dependent rule (transformers `_compute_llama3_parameters`);
    kind "yarn": YaRN (Peng et al. 2023, arXiv 2309.00071): frequencies ramped between interpolated and
    extrapolated over the dimensions whose rotations at the original length fall between beta_slow and beta_fast,
    and cos/sin scaled by an attention factor (transformers `_compute_yarn_parameters`; Qwen3, DeepSeek-V3)."""

    kind: str  # "linear" | "llama3" | "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn's attention factor get_mscale(factor, mscale) / get_mscale(factor, all_dim)
    mscale_all_dim: float | None = None  # deepseek_v3: also scales its softmax by get_mscale(factor, all_dim)²
    attention_factor: float | None = None  # given outright; None: from factor (and mscale, mscale_all_dim)
    truncate: bool = True  # the correction range rounded outwards to whole dimensions


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder shape (GPT-2 style models set `gated_mlp=False`, `kv_heads=heads`).

    The fields after `published_params` carry what a Hugging Face llama/mistral/qwen2/qwen3/gemma3_text
    config.json may change in the math (nightloom/hf/config.py fills them); their defaults are the plain Llama
    decoder, so a family that does not set one is unchanged by it."""

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
    # attention window: a token sees itself and the sliding_window - 1 tokens before it, on every layer (mistral)
    # or on the layers `layer_types` calls sliding (gemma3); None = plain causal attention everywhere
    sliding_window: int | None = None
    qk_norm: bool = False  # per-head RMSNorm (weights of size head_dim) on q and k before RoPE (qwen3, gemma3)
    padded_vocab: int = 0  # embedding/head rows when padded for TP (> vocab); logits are cut back to vocab
    arch: str = "llama"  # Hugging Face model_type written on export
    # -- Gemma 3 (gemma3_text); each default is the Llama decoder's math --
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): 1.0 is Gemma's (1 + w), weights around 0
    post_norms: bool = False  # an RMSNorm on the attention and on the MLP output before each residual add (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(hidden), rounded to the embedding dtype (Gemma)
    mlp_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma); None = head_dim ** -0.5
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention"; () = every layer alike
    rope_local_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma's rope_local_base_freq)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma's final_logit_softcapping)
    # -- mixture of experts (qwen3_moe, mixtral, deepseek_v3); num_experts 0 = a dense model --
    num_experts: int = 0  # routed experts of every MoE layer
    experts_per_token: int = 0  # top-k routed experts each token goes to
    expert_ffn_hidden: int = 0  # intermediate size of one routed expert (and of one shared expert)
    shared_experts: int = 0  # always-active experts of expert_ffn_hidden each (DeepSeek's n_shared_experts)
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP of ffn_hidden (mlp_only_layers...)
    norm_topk_prob: bool = True  # the top-k router weights renormalised to sum to 1 (mixtral always; qwen3_moe flag)
    router_aux_loss_coef: float = 0.0  # load-balancing loss coefficient of the config
    # DeepSeek-V3's router: sigmoid scores, experts picked by score + a bias buffer (aux-loss-free balancing) within
    # the topk_groups best of router_groups expert groups, weights the plain scores (renormalised) times a scale
    router_score: str = "softmax"  # "softmax" (qwen3_moe, mixtral) | "sigmoid" (deepseek_v3)
    router_groups: int = 1  # n_group
    router_topk_groups: int = 1  # topk_group
    routed_scaling: float = 1.0  # routed_scaling_factor
    published_active_params: float | None = None  # activated parameters per token as published (MoE)
    # -- multi-head latent attention (deepseek_v3); kv_lora_rank 0 = standard attention --
    q_lora_rank: int = 0  # low-rank query projection (0: a full h × heads·head_dim query)
    kv_lora_rank: int = 0  # compressed key/value latent
    qk_rope_head_dim: int = 0  # the rotary part of head_dim (head_dim = nope + rope)
    v_head_dim: int = 0  # value head size (0: head_dim)
    rope_interleave: bool = False  # the rotary dims in interleaved pairs (DeepSeek's checkpoints), not rotate-half

    def __post_init__(self) -> None:
        if self.explicit_head_dim is None and self.hidden % self.heads:
            raise ValueError(f"model {self.name}: hidden ({self.hidden}) is not divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads ({self.heads}) is not divisible by kv_heads ({self.kv_heads})")
        if self.padded_vocab and self.padded_vocab < self.vocab:
            raise ValueError(f"model {self.name}: padded_vocab ({self.padded_vocab}) < vocab ({self.vocab})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model {self.name}: sliding_window ({self.sliding_window}) must be >= 1")
        if self.layer_types:
            if len(self.layer_types) != self.layers:
                raise ValueError(f"model {self.name}: {len(self.layer_types)} layer_types for {self.layers} layers")
            odd = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if odd:
                raise ValueError(f"model {self.name}: layer_types {odd} (expected {', '.join(LAYER_TYPES)})")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError(f"model {self.name}: sliding_attention layers need a sliding_window")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts or self.expert_ffn_hidden < 1:
                raise ValueError(
                    f"model {self.name}: {self.num_experts} experts need 1 <= experts_per_token "
                    f"({self.experts_per_token}) <= num_experts and expert_ffn_hidden ({self.expert_ffn_hidden}) >= 1"
                )
            odd = [i for i in self.dense_layers if not 0 <= i < self.layers]
            if odd:
                raise ValueError(f"model {self.name}: dense_layers {odd} outside 0..{self.layers - 1}")
        elif self.experts_per_token or self.shared_experts or self.dense_layers:
            raise ValueError(f"model {self.name}: experts_per_token/shared_experts/dense_layers need num_experts > 0")
        if self.router_score not in ROUTER_SCORES:
            raise ValueError(f"model {self.name}: router_score {self.router_score!r} (expected softmax, sigmoid)")
        if self.num_experts % self.router_groups or not 1 <= self.router_topk_groups <= self.router_groups:
            raise ValueError(
                f"model {self.name}: router_groups ({self.router_groups}) must divide num_experts "
                f"({self.num_experts}) and router_topk_groups ({self.router_topk_groups}) be 1..router_groups"
            )
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"model {self.name}: mlp_act {self.mlp_act!r} (expected {', '.join(MLP_ACTS)})")

    def __hash__(self) -> int:
        """The fields' hash (as the dataclass's own), computed once: the planner's caches key on a shape tens of
        thousands of times a search, and hashing its ~40 fields each time was a tenth of the search."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        """Pickled without the kept hash: another process hashes strings with another seed."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` (global index) attends within `sliding_window` (every layer when layer_types is
        empty and a window is set, as mistral)."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def windowed(self, seq_len: int) -> bool:
        """Whether some layer's window is shorter than `seq_len` (its attention is then not plain causal)."""
        return (
            self.sliding_window is not None
            and self.sliding_window < seq_len
            and any(self.is_sliding(i) for i in range(self.layers))
        )

    def attended(self, layer: int, seq_len: int) -> int:
        """Keys a query of layer `layer` may see at most in a sequence of `seq_len`: min(window, seq_len)."""
        return min(self.sliding_window, seq_len) if self.is_sliding(layer) else seq_len

    def attended_keys(self, seq_len: int) -> int:
        """Keys every layer's query may see, summed over the layers: L·T without a shorter window."""
        return _attended_keys(self, seq_len)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): keys and values from a compressed latent."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Dimensions of a head that RoPE rotates: the rope part under MLA, else the whole head."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model (some layers route tokens to experts)."""
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (global index) has routed experts (not one of `dense_layers`)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> int:
        """How many layers have routed experts."""
        return sum(self.is_moe_layer(i) for i in range(self.layers)) if self.num_experts else 0

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


@lru_cache(maxsize=1024)
def _attended_keys(shape: ModelShape, seq_len: int) -> int:
    """ModelShape.attended_keys, cached: a planner search asks it ~10^5 times for one shape and a few lengths."""
    return sum(shape.attended(layer, seq_len) for layer in range(shape.layers))
