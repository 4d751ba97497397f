"""The catalog: published model shapes by name and GPU facts, the one place the planner, trainer and validation
read them from (a run's model is resolved by `nightloom.model_resolver`; the record is `nightloom.shape`).

Model shapes are the published architectures (Llama 2: Touvron et al. 2023, Table/config.json;
Llama 3: Meta's config.json files). GPU peaks are dense (no sparsity) datasheet figures; each entry
names its source, because MFU against a wrong peak is worse than no MFU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nightloom.shape import ModelShape, RopeScaling


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


def _add(*models: ModelShape) -> None:
    """Enter `models` in MODELS under their names."""
    MODELS.update({m.name: m for m in models})


# Llama 3.1 405B: the same network after long-context pre-training to 128K (config.json: max_position_embeddings
# 131072, rope_scaling llama3, factor 8, low/high frequency factors 1/4, original 8192).
MODELS["llama3.1-405b"] = replace(
    MODELS["llama3-405b"], name="llama3.1-405b", max_seq=131072, rope_scaling=RopeScaling("llama3", 8.0)
)


def _llama32(name, layers, hidden, heads, params):
    """Llama 3.2 1B and 3B (Meta 2024; meta-llama/Llama-3.2-1B and -3B config.json on the Hugging Face Hub): tied
    embeddings, head_dim 64 / 128 (hidden / heads), 8 kv heads, intermediate 8192, vocab 128,256,
    max_position_embeddings 131,072, rope_theta 500,000, rope_scaling llama3 factor 32 (low/high frequency factors
    1/4, original 8192), rms_norm_eps 1e-5, no bias. `params`: the model card's 1.23B and 3.21B."""
    shape = _llama(name, layers, hidden, heads, 8, 8192, 128256, 131072, params, 500000.0)
    return replace(shape, tied_embeddings=True, rope_scaling=RopeScaling("llama3", 32.0))


_add(_llama32("llama3.2-1b", 16, 2048, 32, 1.23e9), _llama32("llama3.2-3b", 28, 3072, 24, 3.21e9))


def _qwen3(name, layers, hidden, heads, ffn, tied, params):
    """Qwen3 dense (Qwen team 2025, the Qwen/Qwen3-* model cards and config.json files on the Hugging Face Hub):
    8 kv heads, head_dim 128 (not hidden/heads for 0.6B, 4B, 32B), per-head q/k RMSNorm, vocab 151,936,
    max_position_embeddings 40,960, rope_theta 1e6, rms_norm_eps 1e-6, no bias. `params`: the model card's
    "Number of Parameters", printed to 0.1B (0.6B, 1.7B for 1.72e9, ...): checks allow for that rounding."""
    return ModelShape(
        name, layers, hidden, heads, 8, ffn, 151936, 40960, tied_embeddings=tied, norm_eps=1e-6, rope_theta=1e6,
        published_params=params, explicit_head_dim=128 if hidden // heads != 128 else None, qk_norm=True,
        arch="qwen3",
    )  # fmt: skip


_add(
    _qwen3("qwen3-0.6b", 28, 1024, 16, 3072, True, 0.6e9),
    _qwen3("qwen3-1.7b", 28, 2048, 16, 6144, True, 1.7e9),
    _qwen3("qwen3-4b", 36, 2560, 32, 9728, True, 4.0e9),
    _qwen3("qwen3-8b", 36, 4096, 32, 12288, False, 8.2e9),
    _qwen3("qwen3-14b", 40, 5120, 40, 17408, False, 14.8e9),
    _qwen3("qwen3-32b", 64, 5120, 64, 25600, False, 32.8e9),
)


def _gemma3(name, layers, hidden, heads, kv, head_dim, ffn, vocab, seq, window, scalar, scaled, params):
    """Gemma 3 text decoders (Gemma Team 2025, "Gemma 3 Technical Report", Table 1; the google/gemma-3-*-pt
    config.json files on the Hugging Face Hub: 1B is gemma3_text, 4B-27B gemma3 image-text whose text_config leaves
    out what Gemma3TextConfig defaults). Written from what we know of those files, not downloaded here: five
    sliding layers to one global (sliding_window_pattern 6; window 512 for 1B, 1024 above), RoPE base 10,000 on
    sliding layers and 1,000,000 on global ones (linear scaling factor 8 there for 4B-27B, 128K context), (1 + w)
    RMSNorms before and after attention and MLP and on q/k, GeGLU (gelu_pytorch_tanh), embeddings times
    sqrt(hidden), tied, rms_norm_eps 1e-6, no soft-capping. `params`: the report's embedding + non-embedding
    parameters of the text decoder (the 417M vision encoder left out): 302M + 698M, 675M + 3,209M,
    1,012M + 10,759M, 1,416M + 25,600M."""
    return ModelShape(
        name, layers, hidden, heads, kv, ffn, vocab, seq, tied_embeddings=True, norm_eps=1e-6, rope_theta=1e6,
        published_params=params, explicit_head_dim=head_dim,
        rope_scaling=RopeScaling("linear", 8.0) if scaled else None, sliding_window=window, qk_norm=True,
        arch="gemma3_text", norm_offset=1.0, post_norms=True, embed_scale=True, mlp_act="gelu_tanh",
        query_pre_attn_scalar=float(scalar), rope_local_theta=1e4,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)),
    )  # fmt: skip


_add(
    _gemma3("gemma3-1b", 26, 1152, 4, 1, 256, 6912, 262144, 32768, 512, 256, False, 1.000e9),
    _gemma3("gemma3-4b", 34, 2560, 8, 4, 256, 10240, 262208, 131072, 1024, 256, True, 3.884e9),
    _gemma3("gemma3-12b", 48, 3840, 16, 8, 256, 15360, 262208, 131072, 1024, 256, True, 11.771e9),
    _gemma3("gemma3-27b", 62, 5376, 32, 16, 128, 21504, 262208, 131072, 1024, 168, True, 27.016e9),
)


def _gpt(name, layers, hidden, heads, params):
    """GPT-3-style shape of Narayanan et al. 2021 (PTD-P) Table 1: vocab 51200, seq 2048, MHA, 4h GELU MLP, tied."""
    return ModelShape(
        name,
        layers,
        hidden,
        heads,
        heads,
        4 * hidden,
        51200,
        2048,
        tied_embeddings=True,
        gated_mlp=False,
        published_params=params,
    )


# PTD-P's published sizes are rounded (1.7 for 1.65e9): checks compare within that rounding.
_add(
    _gpt("gpt-1.7b", 24, 2304, 24, 1.7e9),
    _gpt("gpt-3.6b", 30, 3072, 32, 3.6e9),
    _gpt("gpt-7.5b", 36, 4096, 32, 7.5e9),
    _gpt("gpt-18.4b", 40, 6144, 48, 18.4e9),
    _gpt("gpt-39.1b", 48, 8192, 64, 39.1e9),
    _gpt("gpt-76.1b", 60, 10240, 80, 76.1e9),
    _gpt("gpt-310.1b", 96, 16384, 128, 310.1e9),
    _gpt("gpt-1008b", 128, 25600, 160, 1008e9),
)


def _mcore(name, layers, hidden, heads, params):
    """Megatron-Core's weak-scaling GPT shapes (github.com/NVIDIA/Megatron-LM README, "Performance Benchmarking",
    images/model_table.png): vocab 131,072, seq 4,096, MHA. The MLP (4h, GELU) and the untied output layer are
    not stated there; they are the Megatron GPT defaults and the only reading that gives the published sizes."""
    return ModelShape(
        name, layers, hidden, heads, heads, 4 * hidden, 131072, 4096, tied_embeddings=False, gated_mlp=False,
        published_params=params,
    )  # fmt: skip


_add(
    _mcore("mcore-1.7b", 24, 2048, 16, 1.7e9),
    _mcore("mcore-7.1b", 30, 4096, 32, 7.1e9),
    _mcore("mcore-16b", 32, 6144, 48, 16e9),
    _mcore("mcore-32b", 48, 7168, 56, 32e9),
    _mcore("mcore-70b", 84, 8192, 64, 70e9),
    _mcore("mcore-119b", 92, 10240, 80, 119e9),
    _mcore("mcore-177b", 96, 12288, 96, 177e9),
    _mcore("mcore-314b", 96, 16384, 128, 314e9),
    _mcore("mcore-462b", 112, 18432, 144, 462e9),
)


def _qwen3_moe(name, layers, hidden, heads, kv, expert_ffn, dense_ffn, total, active):
    """Qwen3 mixture of experts (Qwen team 2025; Qwen/Qwen3-30B-A3B and -235B-A22B config.json on the Hugging Face
    Hub): 128 experts, top-8 with norm_topk_prob, decoder_sparse_step 1 and no mlp_only_layers (every layer sparse),
    head_dim 128, per-head q/k RMSNorm, untied, vocab 151,936, max_position_embeddings 40,960, rope_theta 1e6,
    router_aux_loss_coef 0.001. `total`/`active`: the model card's 30.5B/3.3B and 235B/22B."""
    return ModelShape(
        name, layers, hidden, heads, kv, dense_ffn, 151936, 40960, norm_eps=1e-6, rope_theta=1e6,
        published_params=total, explicit_head_dim=128 if hidden // heads != 128 else None, qk_norm=True,
        arch="qwen3_moe", num_experts=128, experts_per_token=8, expert_ffn_hidden=expert_ffn,
        router_aux_loss_coef=0.001, published_active_params=active,
    )  # fmt: skip


_add(
    _qwen3_moe("qwen3-30b-a3b", 48, 2048, 32, 4, 768, 6144, 30.5e9, 3.3e9),
    _qwen3_moe("qwen3-235b-a22b", 94, 4096, 64, 4, 1536, 12288, 235e9, 22e9),
    # Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088; mistralai/Mixtral-8x7B-v0.1 config.json): 8 experts of
    # 14,336, top-2 renormalised, 32 layers, GQA 32/8, vocab 32,000, 32K context, rope_theta 1e6, no window,
    # router_aux_loss_coef 0.02; 46.7B total, 12.9B active (the paper's §2.1).
    ModelShape(
        "mixtral-8x7b",
        32,
        4096,
        32,
        8,
        14336,
        32000,
        32768,
        rope_theta=1e6,
        published_params=46.7e9,
        arch="mixtral",
        num_experts=8,
        experts_per_token=2,
        expert_ffn_hidden=14336,
        router_aux_loss_coef=0.02,
        published_active_params=12.9e9,
    ),  # fmt: skip
    # DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437 §2, §4.2; deepseek-ai/DeepSeek-V3 config.json): 61 layers,
    # the first 3 dense (first_k_dense_replace, ffn 18,432), 256 routed experts of 2,048 top-8 + 1 shared,
    # multi-head latent attention (128 heads, q_lora_rank 1,536, kv_lora_rank 512, qk head 128 + 64 rotary,
    # v head 128), vocab 129,280, 163,840 context (YaRN: factor 40 over 4,096, mscale 1 and 1); 671B total, 37B
    # activated (the 14B multi-token-prediction module of the Hub's 685B is left out, as the paper counts).
    ModelShape(
        "deepseek-v3",
        61,
        7168,
        128,
        128,
        18432,
        129280,
        163840,
        norm_eps=1e-6,
        published_params=671e9,
        explicit_head_dim=192,
        rope_scaling=RopeScaling("yarn", 40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
        arch="deepseek_v3",
        num_experts=256,
        experts_per_token=8,
        expert_ffn_hidden=2048,
        shared_experts=1,
        dense_layers=(0, 1, 2),
        router_score="sigmoid",  # 8 groups of 32 experts, the best 4 groups, weights × 2.5
        router_groups=8,
        router_topk_groups=4,
        routed_scaling=2.5,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
        published_active_params=37e9,
    ),  # fmt: skip
)


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
    hbm_bw: float = 0.0  # device memory bytes/s (memory-bound kernels in the planner's step-time model)
    peak_flops_fp8: float = 0.0  # dense FP8 tensor-core FLOP/s (0: no FP8 tensor cores listed)
    #: host link, bytes/s a direction (activation offload): PCIe 4.0 x16's 31.5 GB/s (PCI-SIG) at the 80% pinned
    #: copies reach; PCIe 5.0 x16 parts (H100, H800, H200, H20) pass 63 GB/s at 80%
    host_bw: float = 0.8 * 31.5e9

    def peak(self, precision: str) -> float:
        """Dense peak for fp32, bf16 or fp8 (train.precision fp8); ValueError where the datasheet lists no FP8."""
        if precision == "fp8":
            if not self.peak_flops_fp8:
                raise ValueError(f"GPU {self.name}: no FP8 tensor-core peak in the catalog (train.precision fp8)")
            return self.peak_flops_fp8
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_bf16


GB = 1e9
TB = 1e12
#: Per-GPU network bandwidth assumes one NIC per GPU (rail-optimised): 8x200 Gb/s HDR on A100/A800 nodes,
#: 8x400 Gb/s NDR on H100/H200 nodes (the reference designs, DGX A100/H100); cheaper clusters differ: override.
#: The A100 and the H100 (SXM) as their datasheets give them; the other parts of their generation differ from
#: them in a few fields (export variants cut NVLink, memory grows), written as such below.
_A100 = GPUSpec(
    "a100-80gb",
    312e12,
    19.5e12,
    80,
    300 * GB,
    25 * GB,
    5e-6,
    10e-6,
    "NVIDIA A100 datasheet (SXM, 2021): 312 TFLOPS BF16 dense, NVLink 600 GB/s bidir, HBM2e 2,039 GB/s",
    2.039 * TB,
)
_H100 = GPUSpec(
    "h100-80gb",
    989e12,
    67e12,
    80,
    450 * GB,
    50 * GB,
    4e-6,
    8e-6,
    "NVIDIA H100 datasheet (SXM5): 989 TFLOPS BF16 dense, NVLink 900 GB/s bidir, HBM3 3.35 TB/s",
    3.35 * TB,
    peak_flops_fp8=1979e12,  # datasheet: 1,979 TFLOPS FP8 dense (3,958 with sparsity)
    host_bw=0.8 * 63e9,  # PCIe 5.0 x16
)
_GPU_LIST = (
    replace(
        _A100,
        name="a100-40gb",
        memory_gib=40,
        hbm_bw=1.555 * TB,
        source="NVIDIA A100 datasheet (SXM, 2021): 312 TFLOPS BF16 dense, NVLink 600 GB/s bidir, HBM2 1,555 GB/s",
    ),
    _A100,
    replace(
        _A100,
        name="a800-80gb",
        intra_node_bw=200 * GB,
        source="NVIDIA A800 datasheet (SXM): 312 TFLOPS BF16 dense, NVLink 400 GB/s bidir, HBM2e 2,039 GB/s",
    ),
    _H100,
    replace(
        _H100,
        name="h800",
        intra_node_bw=200 * GB,
        source="NVIDIA H800 SXM5 product brief: H100 compute (989 TFLOPS BF16 dense), NVLink 400 GB/s bidir, "
        "HBM3 3.35 TB/s",
    ),
    replace(
        _H100,
        name="h200",
        memory_gib=140,
        hbm_bw=4.8 * TB,
        source="NVIDIA H200 datasheet (SXM): 989 TFLOPS BF16 dense, 141 GB HBM3e (~140 GiB usable), "
        "4.8 TB/s, NVLink 900 GB/s bidir",
    ),
    replace(
        _H100,
        name="h20",
        peak_flops_bf16=148e12,
        peak_flops_fp32=44e12,
        memory_gib=96,
        hbm_bw=4.0 * TB,
        peak_flops_fp8=0.0,
        source="NVIDIA H20 product brief: 148 TFLOPS BF16 dense, 96 GB HBM3 4.0 TB/s, NVLink 900 GB/s bidir",
    ),
    GPUSpec(
        "l40s",
        362e12,
        91.6e12,
        48,
        32 * GB,
        12.5 * GB,
        10e-6,
        15e-6,
        "NVIDIA L40S datasheet: 362 TFLOPS BF16 dense (733 sparse), 48 GB GDDR6 864 GB/s, "
        "PCIe Gen4 x16 (no NVLink); network assumed 100 Gb/s per GPU",
        0.864 * TB,
    ),
    GPUSpec(
        "rtx-4090",
        165.2e12,
        82.6e12,
        24,
        25 * GB,
        3 * GB,
        15e-6,
        20e-6,
        "NVIDIA Ada (AD102) whitepaper, RTX 4090: 165.2 TFLOPS BF16 with FP32 accumulate dense, "
        "24 GB GDDR6X 1,008 GB/s, PCIe Gen4 x16, no NVLink/P2P; network assumed 25 Gb/s per GPU",
        1.008 * TB,
    ),
    GPUSpec(
        "ascend-910b",
        313e12,
        78e12,
        64,
        196 * GB,
        25 * GB,
        6e-6,
        12e-6,
        "Huawei Atlas 800T A2 / Ascend 910B (figures as commonly quoted, no public datasheet): "
        "~313 TFLOPS FP16/BF16 dense, 64 GB HBM2e 1.6 TB/s, HCCS 392 GB/s bidir "
        "(7 links, full mesh of 8), 200 GbE RoCE per NPU",
        1.6 * TB,
    ),
)
GPUS: dict[str, GPUSpec] = {g.name: g for g in _GPU_LIST}
#: Other spellings people type (CLI, specs) for the same entries.
GPU_ALIASES = {
    "a100": "a100-80gb",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h800-80gb": "h800",
    "h200-141gb": "h200",
    "h20-96gb": "h20",
    "l40s-48gb": "l40s",
    "4090": "rtx-4090",
    "rtx4090": "rtx-4090",
    "910b": "ascend-910b",
    "ascend910b": "ascend-910b",
}


def get_model(name: str) -> ModelShape:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def get_gpu(name: str) -> GPUSpec:
    try:
        key = name.lower()
        return GPUS[GPU_ALIASES.get(key, key)]
    except KeyError:
        raise KeyError(f"unknown GPU type {name!r}; known: {', '.join(sorted(GPUS))}") from None
