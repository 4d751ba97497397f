"""The train.grpo section (train.task grpo): reinforcement learning with verifiable rewards, GRPO (Shao et al. 2024)
with Dr. GRPO's and DAPO's fixes: how prompts are sampled (the group, max tokens, temperature, top-p/top-k, stop
strings), the clipped loss (epsilon low/high, beta, the normalisation, iterations per batch, reward scaling,
masking of truncated completions) and the reward functions with their weights; `layout_error`, the layouts it runs
on; the rollout engine (`engine`: native, or vLLM colocated in each training rank, `VLLMSpec`) and `engine_errors`,
the clusters and layouts the vllm engine is refused on.

A leaf of the spec package (floor 0): it imports only the section base. Defaults are TRL 1.16's GRPOConfig (beta 0,
loss dapo, epsilon 0.2, scale_rewards group, temperature 1); the reward functions are resolved and their
signatures checked by nightloom/train/rollout/rewards.py (`check_rewards`), the loss is nightloom/train/rollout/grpo.py.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nightloom.spec.base import Section as _Section

BUILTIN_REWARDS = ("accuracy", "format", "length")
_TARGET = re.compile(r"^(?:[^:]+\.py|[A-Za-z_][\w.]*):[A-Za-z_]\w*$")


class RewardSpec(_Section):
    """One reward function and its weight in the total."""

    fn: str = Field(
        ...,
        description="accuracy (the completion's final answer equals the row's `answer`; math-verify compares "
        "mathematical answers), format (args.pattern, a regular expression the whole completion must match), "
        "length (DAPO's soft overlong punishment: args.max_tokens, args.cache_tokens), or your own "
        "`reward(prompts, completions, **row) -> list[float]` as `path/to/file.py:function` (relative to the spec) "
        "or `package.module:function`.",
    )
    weight: float = Field(1.0, description="Its weight in the reward (the weighted sum of every function's).")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments bound to the function.")

    @field_validator("fn")
    @classmethod
    def _fn(cls, v: str) -> str:
        if v in BUILTIN_REWARDS or _TARGET.match(v):
            return v
        raise ValueError(
            f"{v!r}: expected a built-in ({', '.join(BUILTIN_REWARDS)}), 'path/to/file.py:function' or "
            "'package.module:function'"
        )


#: the vllm release the engine runs with: the only one whose torch pin is nightloom's torch (2.13.0), read from its
#: wheel's METADATA (vllm 0.33 and 0.34 pin torch 2.14.0); docs/finetuning.md says how it reaches a GPU node
VLLM_PIN = "vllm==0.32.0"


class VLLMSpec(_Section):
    """The vllm rollout engine's share of each GPU and its sleep around training (train.grpo.engine: vllm)."""

    gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="The share of each GPU's memory vLLM takes for its weights and KV cache (vLLM's "
        "gpu_memory_utilization); the trainer's model, gradients and optimizer live in the rest.",
    )
    sleep: bool = Field(
        False,
        description="Put vLLM to sleep (level 2: weights and KV cache freed) while the trainer runs its forward, "
        "backward and optimizer step, and wake it for each rollout (weights pushed again): memory for training at "
        "the cost of re-allocating vLLM's at every round (TRL's vllm_enable_sleep_mode).",
    )


class GRPOSpec(_Section):
    """Rollouts, rewards and the GRPO loss (train.task grpo)."""

    engine: Literal["native", "vllm"] = Field(
        "native",
        description="What samples the completions: native (generation with a KV cache over the training model "
        "itself, any device), or vllm (a vLLM engine colocated in each training rank on its GPU, the trainer's "
        f"weights pushed to it after every optimizer step; CUDA GPUs and {VLLM_PIN} on the nodes, parallel.tp 1; "
        "its sampler is vLLM's, so completions are not bit-equal to native's).",
    )
    vllm: VLLMSpec | None = Field(
        None, description="The vllm engine's memory share and sleep mode (engine: vllm; null: the defaults)."
    )

    prompts_per_step: int = Field(4, gt=0, description="Prompts per optimizer step over all data-parallel ranks.")
    num_generations: int = Field(
        8, ge=2, description="Completions sampled per prompt: the group whose rewards set each one's advantage."
    )
    max_completion_tokens: int = Field(64, gt=0, description="A completion ends here at the latest (truncated).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the log-probs are of logits / it).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set reaching this mass.")
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens (0: all).")
    stop: list[str] = Field(default_factory=list, description="Stop strings: a completion ends with the one it hits.")
    epsilon: float = Field(0.2, gt=0, lt=1, description="The ratio's lower clip, 1 - epsilon.")
    epsilon_high: float | None = Field(
        None, gt=0, description="The ratio's upper clip, 1 + epsilon_high (DAPO's clip-higher: 0.28); None: epsilon."
    )
    beta: float = Field(
        0.0, ge=0, description="Weight of the KL to the reference (0, TRL's default: no reference is computed)."
    )
    iterations: int = Field(
        1,
        ge=1,
        description="Optimizer steps on each generated batch (GRPO's μ): the ratio moves off 1 after the first.",
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "dapo",
        description="How token losses are summed: grpo, each completion's mean then the batch mean; dr_grpo, the sum "
        "over prompts x max tokens (Liu et al. 2025: no length bias); dapo, over the batch's completion tokens.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantages divided by the std of the group's rewards, of the batch's, or not (Dr. GRPO)."
    )
    mask_truncated: bool = Field(
        False, description="Leave completions cut at max_completion_tokens out of the loss (DAPO's overlong filter)."
    )
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(fn="accuracy")],
        min_length=1,
        description="The reward functions and their weights.",
    )
    eval_prompts: int = Field(
        32, ge=0, description="Held-out prompts scored at validate.eval_every (mean reward of sampled completions)."
    )
    log_completions_every: int = Field(
        0, ge=0, description="Every N steps, a table of sampled completions with their rewards (0: never)."
    )
    chat_template: bool | None = Field(
        None,
        description="Prompts through the tokenizer's chat template (transformers' apply_chat_template, the generation "
        "prompt added, as TRL's GRPOTrainer): true, every prompt (a text as one user message); null, the chat-shaped "
        "ones (a JSON list of role/content messages); false, none (a chat-shaped prompt is refused).",
    )

    @model_validator(mode="after")
    def _clip(self) -> GRPOSpec:
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(f"epsilon_high: {self.epsilon_high} is below epsilon ({self.epsilon})")
        if self.vllm is not None and self.engine != "vllm":
            raise ValueError("vllm: applies to engine: vllm only")
        return self

    @property
    def vllm_settings(self) -> VLLMSpec:
        return self.vllm or VLLMSpec()

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def grpo_global_batch(train: object) -> object:
    """A raw train section of train.task grpo with its global_batch, the completions of one optimizer step
    (prompts_per_step x num_generations): filled in when absent, refused naming both when it differs."""
    if not isinstance(train, dict) or train.get("task") != "grpo":
        return train
    g = train.get("grpo")
    g = g.model_dump() if isinstance(g, GRPOSpec) else g if isinstance(g, dict) else {}
    fields = GRPOSpec.model_fields
    per, group = (g.get(k, fields[k].default) for k in ("prompts_per_step", "num_generations"))
    if not isinstance(per, int) or not isinstance(group, int):
        return train  # the section's own checks name what is wrong
    if train.get("global_batch") is None:
        return {**train, "global_batch": per * group}
    if train["global_batch"] != per * group:
        raise ValueError(
            f"train.global_batch: {train['global_batch']}: a grpo step trains on its completions, "
            f"train.grpo.prompts_per_step x num_generations = {per} x {group} = {per * group} (or leave it out)"
        )
    return train


def layout_error(task: str, grpo, lora, backend: str, parallel) -> str | None:
    """Why train.task / train.grpo / the layout do not go together, or None. GRPO's rollouts run inside the
    training ranks: one process, FSDP2 (shards gathered for generation) or TP without sequence parallelism. The
    KL term's reference is the base with the LoRA adapters off (no second copy), so beta > 0 needs train.lora."""
    if task != "grpo":
        return None if grpo is None else "train.grpo: applies to train.task: grpo only"
    if backend != "native":
        return "train.task: grpo runs on the native backend only (train.backend: native)"
    if grpo is not None and grpo.beta > 0 and lora is None:
        return (
            f"train.grpo.beta: {grpo.beta}: the KL term's reference is the base with the adapters off: it needs "
            "train.lora (or beta: 0, TRL's default)"
        )
    if parallel == "auto":
        return None
    for name, degree in (("pp", parallel.pp), ("cp", parallel.cp), ("ep", parallel.ep)):
        if degree > 1:
            return (
                f"parallel.{name}: {degree}: train.task grpo generates inside the training ranks, on one process, "
                f"FSDP2 or TP; {name} > 1 is not supported"
            )
    if parallel.sp:
        return "parallel.sp: true: train.task grpo's rollouts do not run under sequence parallelism; set sp: false"
    return None


def _raw(data: object, *path: str) -> object:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def engine_errors(data: dict, vllm_importable: bool) -> list[tuple[tuple[str, ...], str]]:
    """(field path, reason) for train.grpo.engine vllm on a spec's raw mapping that cannot run it: a cluster without
    CUDA GPUs; vllm not on the node profile (the local provider: importable here; ssh and slurm: `VLLM_PIN` in
    cluster.env_requirements, which builds the nodes' environment; kubernetes: the image's, checked on the node);
    layouts a colocated engine cannot serve (tp > 1: vLLM's own tensor parallelism over the trainer's TP groups is
    not wired; parallel: auto is planned with tp 1); a base or modules it cannot take pushed weights of."""
    if _raw(data, "train", "task") != "grpo" or _raw(data, "train", "grpo", "engine") != "vllm":
        return []
    where, errs = ("train", "grpo", "engine"), []
    if _raw(data, "cluster", "gpu_type") in (None, "cpu"):
        errs.append((where, "vllm runs on CUDA GPUs; cluster.gpu_type is cpu (use engine: native)"))
    provider = _raw(data, "cluster", "provider")
    kind = provider.get("kind") if isinstance(provider, dict) else provider or "local"
    reqs = [str(r).replace(" ", "") for r in _raw(data, "cluster", "env_requirements") or []]
    if kind == "local" and not vllm_importable:
        errs.append((where, f"vllm is not importable in this environment (the local nodes'): install {VLLM_PIN}"))
    elif kind in ("ssh", "slurm") and VLLM_PIN not in reqs:
        named = [r for r in reqs if re.match(r"vllm\b", r)]
        why = f"{named[0]!r} is not {VLLM_PIN}, the release built for torch 2.13.0" if named else "it is not there"
        errs.append((where, f"vllm on the nodes needs {VLLM_PIN!r} in cluster.env_requirements: {why}"))
    tp = _raw(data, "parallel", "tp")
    if isinstance(tp, int) and tp > 1:
        errs.append((where, f"vllm runs colocated with tp 1 in each rank (FSDP2 across them); parallel.tp is {tp}"))
    temperature = _raw(data, "train", "grpo", "temperature")
    if isinstance(temperature, (int, float)) and temperature > 2:
        errs.append((where, f"vLLM samples at temperatures up to 2; train.grpo.temperature is {temperature}"))
    tok = _raw(data, "model", "tokenizer")
    kind = tok if isinstance(tok, str) else _raw(tok, "kind") or ("auto" if _raw(tok, "path") else "bytes")
    if _raw(data, "train", "grpo", "stop") and kind in ("bytes", "tiktoken", "sentencepiece"):
        errs.append((where, f"vLLM matches stop strings with a Hugging Face tokenizer; model.tokenizer is {kind}"))
    lora = _raw(data, "train", "lora")
    for name in ("quantize", "modules_to_save", "trainable_token_indices"):
        if isinstance(lora, dict) and lora.get(name):
            errs.append((where, f"vllm takes merged full weights; train.lora.{name} is not pushed to it yet"))
    return errs
