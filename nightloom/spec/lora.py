"""The train.lora section: LoRA's rank, scale and targets, its variants (rsLoRA, DoRA, a quantized base: QLoRA)
and what is trained beside the adapters (whole modules, or only some tokens' embedding rows, as PEFT's
modules_to_save and trainable_token_indices); `lora_layout_error`, the layouts and tasks they run with.

A leaf of the spec package (floor 0): it imports only the section base.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from nightloom.spec.base import Section as _Section

#: Hugging Face module names a LoRA adapter may target (the decoder's linears); "all-linear" is all of them
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: modules train.lora.modules_to_save may train in full (Hugging Face names)
SAVE_TARGETS = ("embed_tokens", "lm_head")


class LoraSpec(_Section):
    """Low-rank adapters (Hu et al. 2021) on the decoder's linears: W x + (alpha / rank) · B A dropout(x), the
    base frozen (no gradients, no optimizer state), A and B trained; exported merged and as a PEFT adapter."""

    rank: int = Field(8, gt=0, description="r: the adapters' inner size (a multiple of parallel.tp).")
    alpha: float = Field(16.0, gt=0, description="The update is scaled by alpha / rank (PEFT's lora_alpha).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input (PEFT's lora_dropout).")
    targets: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="Hugging Face module names to adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj), or all-linear for every one of them.",
    )

    @field_validator("targets")
    @classmethod
    def _targets(cls, v):
        if isinstance(v, str):
            return v
        unknown = [t for t in v if t not in LORA_TARGETS]
        if unknown or not v:
            raise ValueError(
                f"unknown module {unknown or v!r}: expected some of {', '.join(LORA_TARGETS)}, or all-linear"
            )
        return sorted(set(v), key=LORA_TARGETS.index)

    quantize: Literal["nf4", "fp4", "int8"] | None = Field(
        None,
        description="QLoRA (Dettmers et al. 2023): hold the frozen base's decoder linears quantized, each rank "
        "quantizing its own shard on load (bitsandbytes' blockwise nf4/fp4, or int8 per row); one process or "
        "FSDP2 only (tp and pp refused). None: the base in the run's precision.",
    )
    double_quant: bool = Field(
        True, description="nf4/fp4: quantize the blocks' scales too (BitsAndBytesConfig's bnb_4bit_use_double_quant)."
    )
    compute_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="dtype the quantized base is dequantized to per forward; auto: the activations' dtype."
    )
    use_rslora: bool = Field(
        False,
        description="Rank-stabilized LoRA (Kalajdzievski 2023): scale the update by alpha / sqrt(rank) instead of "
        "alpha / rank (PEFT's use_rslora).",
    )
    use_dora: bool = Field(
        False,
        description="DoRA (Liu et al. 2024): the adapted weight is a trained magnitude per output row times the "
        "direction (W + B A) / its row norm (PEFT's use_dora); over a quantized base too. One process or FSDP2 "
        "(parallel.tp 1).",
    )
    merged_export: bool | None = Field(
        None,
        description="Also write the merged 16-bit model to export/ (the adapter is always written to "
        "export/adapter/). None: merged for a 16-bit base, the adapter alone onto the 4-bit base with quantize "
        "(merging into the dequantized base rounds; docs/finetuning.md).",
    )

    modules_to_save: list[str] | None = Field(
        None,
        description="Modules trained in full beside the adapters (PEFT's modules_to_save): embed_tokens and/or "
        "lm_head, e.g. after adding chat special tokens to the tokenizer. Kept in the adapter-only checkpoint and "
        "written into the PEFT adapter; a tied embedding is one matrix (either name trains it). Not with "
        "train.task dpo nor grpo's KL term (their reference is the model with the adapters off).",
    )
    trainable_token_indices: list[int] | None = Field(
        None,
        description="Token ids whose embedding rows alone are trained (PEFT's trainable_token_indices, "
        "TrainableTokens): new special tokens without training the whole embedding; each below the vocabulary. "
        "Not with a tied embedding (use modules_to_save: [embed_tokens]) nor parallel.tp > 1.",
    )

    @field_validator("modules_to_save")
    @classmethod
    def _saved(cls, v):
        if v is None:
            return v
        unknown = [m for m in v if m not in SAVE_TARGETS]
        if unknown or not v:
            raise ValueError(f"unknown module {unknown or v!r}: expected some of {', '.join(SAVE_TARGETS)}")
        return sorted(set(v), key=SAVE_TARGETS.index)

    @field_validator("trainable_token_indices")
    @classmethod
    def _tokens(cls, v):
        if v is None:
            return v
        bad = [i for i in v if i < 0]
        if bad or not v or len(set(v)) != len(v):
            why = f"negative ids {bad}" if bad else "empty" if not v else "repeated ids"
            raise ValueError(f"{why}: expected distinct token ids >= 0 (the rows to train)")
        return v

    @model_validator(mode="after")
    def _rows_once(self):
        if self.trainable_token_indices and "embed_tokens" in (self.modules_to_save or []):
            raise ValueError(
                "trainable_token_indices: modules_to_save trains the whole embedding already; set one of them"
            )
        return self

    def modules(self) -> tuple[str, ...]:
        """The targeted Hugging Face module names, in a fixed order."""
        return LORA_TARGETS if self.targets == "all-linear" else tuple(self.targets)


def lora_layout_error(lora: LoraSpec | None, parallel, task: str, grpo_beta: float = 0.0) -> str | None:
    """Why train.lora's variants do not go with this layout or task, or None: DoRA's row norm needs whole rows
    (tp 1), token rows are not split over TP, modules trained in full have run in one process and FSDP2 only (tp = pp
    = 1), and a reference that is the model with its adapters off (dpo, grpo's
    KL term) has no off for a module trained in full."""
    if lora is None:
        return None
    if lora.modules_to_save and (task == "dpo" or (task == "grpo" and grpo_beta > 0)):
        what = "train.task dpo" if task == "dpo" else f"train.grpo.beta {grpo_beta}"
        return (
            f"train.lora.modules_to_save: {what} scores its reference with the adapters off, which a module "
            "trained in full has not; use trainable_token_indices for new tokens' rows"
        )
    tp = 1 if parallel == "auto" else parallel.tp
    if lora.use_dora and tp > 1:
        return f"train.lora.use_dora: DoRA runs in one process or under FSDP2; parallel.tp {tp} must be 1"
    if lora.trainable_token_indices and tp > 1:
        return f"train.lora.trainable_token_indices: the rows are trained in one process or FSDP2; parallel.tp {tp} must be 1"
    pp = 1 if parallel == "auto" else parallel.pp
    if lora.modules_to_save and (tp > 1 or pp > 1):  # not yet run under a vocab-sharded or pipelined embedding
        return (
            f"train.lora.modules_to_save: the modules are trained in one process or FSDP2; parallel.tp {tp} and "
            f"parallel.pp {pp} must be 1"
        )
    return None
