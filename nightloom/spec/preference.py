"""The train.preference section (train.task dpo): the pairwise loss, its β, label smoothing and SimPO's margin,
and how the reference's log-probs are had; `layout_error`, the layouts preference tuning runs on.

A leaf of the spec package (floor 0): it imports only the section base. Defaults are TRL 1.16's (DPOConfig:
beta 0.1, label_smoothing 0; CPOConfig: simpo_gamma 0.5), the losses' sources in nightloom/train/preference/losses.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nightloom.spec.base import Section as _Section

PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo", "orpo")


class PreferenceSpec(_Section):
    """How chosen is preferred to rejected (train.task dpo)."""

    loss: Literal["sigmoid", "ipo", "simpo", "orpo"] = Field(
        "sigmoid",
        description="sigmoid: DPO (Rafailov et al. 2023); ipo: IPO (Azar et al. 2023), on per-token averaged "
        "log-ratios; simpo: SimPO (Meng et al. 2024), reference-free, average log-probs with a target margin; "
        "orpo: ORPO (Hong et al. 2024), reference-free, the chosen's NLL plus β times the odds-ratio term.",
    )
    beta: float = Field(
        0.1,
        gt=0,
        description="β: how far from the reference the policy may go (sigmoid), IPO's τ, SimPO's reward scale, "
        "ORPO's weight of the odds-ratio term (TRL's default 0.1 for all).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="ε, the share of pairs assumed flipped: the conservative loss -(1-ε)·log σ(x) - ε·log σ(-x) "
        "(sigmoid and simpo only).",
    )
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target reward margin γ (loss simpo only).")
    reference: Literal["auto", "adapters_off", "precomputed", "frozen_copy"] = Field(
        "auto",
        description="The reference's log-probs (sigmoid, ipo): adapters_off, the base with the LoRA adapters "
        "disabled (no second copy; needs train.lora); precomputed, computed once before training with the "
        "initial weights and stored beside the shards, keyed by the model's and the shards' hashes (reused by "
        "the next night and after a preemption); frozen_copy (full fine-tuning), a second copy of the initial "
        "weights sharded as the policy (FSDP2, TP), no gradients or optimizer state, one no-grad forward per "
        "step (more memory, nothing stored); auto: adapters_off with LoRA, else precomputed.",
    )

    @model_validator(mode="after")
    def _smoothing(self) -> PreferenceSpec:
        if self.label_smoothing and self.loss not in ("sigmoid", "simpo"):
            raise ValueError(f"label_smoothing: applies to the sigmoid and simpo losses, not {self.loss}")
        return self

    @property
    def needs_reference(self) -> bool:
        return self.loss in ("sigmoid", "ipo")

    def reference_how(self, lora: bool) -> str:
        """adapters_off, precomputed or none (simpo, orpo), with auto resolved."""
        if not self.needs_reference:
            return "none"
        if self.reference == "auto":
            return "adapters_off" if lora else "precomputed"
        return self.reference


def layout_error(task: str, preference, lora, backend: str, parallel) -> str | None:
    """Why a spec's train.task / train.preference / layout do not go together, or None. Preference tuning runs
    in one process, on FSDP2, TP (+SP) and LoRA; pipeline, context and expert parallelism are refused by name."""
    if task != "dpo":
        return None if preference is None else "train.preference: applies to train.task: dpo only"
    if backend != "native":
        return "train.task: dpo runs on the native backend only (train.backend: native)"
    pref = preference or PreferenceSpec()
    if pref.reference == "adapters_off" and lora is None:
        return "train.preference.reference: adapters_off is the base without its adapters: it needs train.lora"
    if pref.reference == "frozen_copy" and lora is not None:
        return (
            "train.preference.reference: frozen_copy is a second copy for full fine-tuning; with train.lora the "
            "base with its adapters off is the reference without one (adapters_off, or auto)"
        )
    if parallel == "auto":
        return None
    for name, degree in (("pp", parallel.pp), ("cp", parallel.cp), ("ep", parallel.ep)):
        if degree > 1:
            return (
                f"parallel.{name}: {degree}: train.task dpo runs in one process, on FSDP2 (dp_shard, dp_replicate), "
                f"TP (+sp) and LoRA; {name} > 1 is not supported for preference tuning"
            )
    return None
