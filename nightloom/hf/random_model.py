"""A small random Hugging Face model folder built with transformers: the continue-pretrain demo's starting
checkpoint (nothing can be downloaded on the machines this demo runs on) and the tests' reference models.

Deterministic (seeded); written to a temp folder and renamed, so a half-built folder is never picked up."""

from __future__ import annotations

import shutil
from pathlib import Path

from nightloom.families import DEMO_FAMILY, family_for
from nightloom.util import quiet_progress, share_mode

DEMO_CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 500000.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
}


def build_random_model(
    out: str | Path,
    arch: str = DEMO_FAMILY,
    seed: int = 0,
    max_shard_size: str = "5GB",
    bias_std: float = 0.0,
    norm_std: float = 0.0,
    **config,
) -> Path:
    """Write `<out>` = config.json, generation_config.json, *.safetensors (+ index when sharded) of a random
    `arch` model: any registered family with `hf_classes` (nightloom/families/; mixture-of-experts ones saved in the
    Hub's per-expert layout). `bias_std` > 0 gives biases random values (deepseek_v3's expert-choice bias too)
    (transformers zeroes them), `norm_std` > 0 gives RMSNorm weights a scale of 1 + N(0, norm_std) (transformers
    sets the scale to 1: weight 1, or 0 for Gemma's (1 + w) norms), so a bias or a norm weight that is not loaded
    shows in a parity check. gemma3_text takes Gemma3TextConfig's own arguments (sliding_window, layer_types,
    query_pre_attn_scalar, rope_local_base_freq, rope_scaling ...; rope_theta is the global layers' base)."""
    import torch
    import transformers

    family = family_for(arch)
    if family is None or family.hf_classes is None:
        raise ValueError(f"no random model for model_type {arch!r}")
    cfg_cls, model_cls = (getattr(transformers, cls) for cls in family.hf_classes)
    final = Path(out)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**DEMO_CONFIG, **config}))
    unit = family.norm_unit  # the weight that scales by 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if bias_std and name.endswith(".bias"):
                p.normal_(0.0, bias_std)
            if norm_std and name.endswith("norm.weight"):
                p.normal_(unit, norm_std)
        for name, b in model.named_buffers():
            if bias_std and name.endswith("e_score_correction_bias"):  # deepseek_v3's expert-choice bias
                b.normal_(0.0, bias_std)
    with quiet_progress():  # no "Writing model shards" bar in a demo's output
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
    share_mode(tmp)  # safetensors writes 0600: the usual mode, readable as the rest
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def ensure_demo_weights(folder: str | Path, config: str | Path | None = None) -> Path:
    """The demo's starting checkpoint: built once, reused after. `config` (a spec's model.config outside the
    folder, e.g. deployments/chat-sft-demo.json) gives its architecture and sizes; else DEMO_CONFIG's Llama."""
    import json

    p = Path(folder)
    if (p / "config.json").is_file():
        return p
    if config is not None and Path(config).is_file() and Path(config).resolve() != (p / "config.json").resolve():
        cfg = json.loads(Path(config).read_text(encoding="utf-8"))
        arch = cfg.pop("model_type", DEMO_FAMILY)
        cfg.pop("architectures", None)
        build_random_model(p, arch=arch, max_shard_size="200KB", **cfg)
    else:
        build_random_model(p, max_shard_size="200KB")
    return p
