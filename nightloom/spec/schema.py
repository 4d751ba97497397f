"""RunSpec: the schema of the declarative run spec (pydantic models, their defaults and per-field rules).

A leaf: it imports nothing of nightloom but its package's floor-0 parts (base.py: the section base and SpecError;
cluster.py: the cluster section; stage_list.py and micro_batch.py). Reading a YAML file with every error as
`FILE:LINE: field.path: reason` is `nightloom.spec.load`; the checks that need a model, a tokenizer or the
filesystem are `nightloom.spec.checks`. Unknown keys are errors so a typo is never silently ignored. Relative paths in
a spec file resolve against the directory of that file; in a spec built in Python they resolve against the working
directory.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from nightloom.spec.base import Section as _Section
from nightloom.spec.base import SpecError
from nightloom.spec.cluster import (
    PROVIDER_KINDS,
    ClusterSpec,
    KubernetesSpec,
    LocalSpec,
    NCCLSpec,
    ProviderSpec,
    SlurmSpec,
    SSHHost,
    SSHSpec,
)
from nightloom.spec.gates import GoldenSpec, ValidateSpec
from nightloom.spec.grpo import GRPOSpec, grpo_global_batch
from nightloom.spec.grpo import layout_error as grpo_layout_error
from nightloom.spec.lora import LoraSpec, lora_layout_error
from nightloom.spec.micro_batch import micro_batches_per_step
from nightloom.spec.operations import LedgerSpec, RecoverySpec, ScheduleSpec, StorageSpec, WindowSpec
from nightloom.spec.preference import PreferenceSpec, layout_error
from nightloom.spec.quality import FiltersSpec, NearDupSpec
from nightloom.spec.stage_list import stage_list_errors
from nightloom.spec.tracking import TrackSpec

__all__ = [  # the cluster section and the base live in their own leaves; nightloom/spec/__init__.py re-exports all
    "PROVIDER_KINDS",
    "ClusterSpec",
    "GoldenSpec",
    "KubernetesSpec",
    "LedgerSpec",
    "LocalSpec",
    "NCCLSpec",
    "ProviderSpec",
    "RecoverySpec",
    "ScheduleSpec",
    "SlurmSpec",
    "SpecError",
    "SSHHost",
    "SSHSpec",
    "StorageSpec",
    "ValidateSpec",
    "WindowSpec",
]


class TokenizerSpec(_Section):
    """The run's tokenizer (nightloom/tokenizer.py). In a spec, a plain string is shorthand: `bytes`, or a path
    (a folder with tokenizer.json, a SentencePiece `*.model`, or any other file = a tiktoken rank file)."""

    kind: Literal["auto", "bytes", "hf", "tiktoken", "sentencepiece"] = Field(
        "auto", description="auto: bytes without a path; else from the path (folder hf, *.model sentencepiece)."
    )
    path: str | None = Field(None, description="Tokenizer folder (tokenizer.json) or file (local path).")
    pattern: str | None = Field(
        None, description="tiktoken: the split regex, or a tiktoken encoding name (cl100k_base, o200k_base ...)."
    )
    special_tokens: dict[str, int] = Field(
        default_factory=dict, description="tiktoken: special token text -> id (default: the named encoding's)."
    )
    bos: str | None = Field(None, description="BOS token text (default: tokenizer_config.json / the model's).")
    eos: str | None = Field(None, description="EOS token text, appended after every document.")
    add_bos: bool = Field(False, description="tiktoken/sentencepiece: prepend BOS (HF: its own template rules).")
    train_vocab: int | None = Field(
        None,
        gt=0,
        description="Train a byte-level BPE of at most this many tokens on dataset.path and save it at `path` "
        "(tokenizer.json + tokenizer_config.json) on first use (demos).",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v):
        if isinstance(v, str):
            return {"kind": "bytes"} if v == "bytes" else {"path": v}
        return v

    @classmethod
    def coerce(cls, v: TokenizerSpec | str | dict | None) -> TokenizerSpec:
        return v if isinstance(v, TokenizerSpec) else cls.model_validate(v if v is not None else "bytes")

    @property
    def is_bytes(self) -> bool:
        return self.kind == "bytes" or (self.kind == "auto" and self.path is None)


class ModelSpec(_Section):
    """Which model to train: a catalog name (see nightloom/catalog.py) or a Hugging Face config.json."""

    name: str = Field("tiny", description="Catalog model name, e.g. tiny, llama3-70b, llama3.2-1b, qwen3-8b.")
    config: str | None = Field(
        None,
        description="A Hugging Face config.json (llama, mistral, qwen2, qwen3, gemma3; tied or untied embeddings, "
        "under every layout), or a folder holding one; overrides `name`. Default: the `weights` folder's config.json.",
    )
    weights: str | None = Field(
        None,
        description="Hugging Face weights to start from: a local folder or s3:// prefix of *.safetensors "
        "(+ model.safetensors.index.json), loaded into each rank's shards; a resumed checkpoint wins.",
    )
    build_demo_weights: bool = Field(
        False, description="Build a small random Llama at `weights` on first use (demos and tests only)."
    )
    tokenizer: TokenizerSpec = Field(
        default_factory=TokenizerSpec,
        description="`bytes` (UTF-8 bytes, vocab 256), a tokenizer path, or a mapping (see TokenizerSpec).",
    )
    vocab: int | Literal["tokenizer"] | None = Field(
        None, description="Embedding rows: the model's own (null), a number, or `tokenizer` (the tokenizer's size)."
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template file for train.task sft (rendered by transformers' apply_chat_template); "
        "default the tokenizer's own (tokenizer_config.json `chat_template`, or chat_template.jinja).",
    )


class DatasetSpec(_Section):
    """The training corpus: a local path or s3:// prefix; `sample: true` builds the embedded sample."""

    path: str = Field(..., description="JSONL(.gz/.zst), Parquet, a folder of .txt files, or save_to_disk folder.")
    format: Literal["auto", "jsonl", "parquet", "text", "hf"] = Field("auto", description="auto: from the path.")
    text_field: str = Field(
        "text",
        description="Field holding the document text (a string; a chat messages list, {role, content} objects, is "
        "stored as its JSON text: train.grpo's chat prompts).",
    )
    keep_columns: list[str] = Field(
        default_factory=list,
        description="Extra fields copied into every shard row as strings (non-string values such as lists or "
        "dicts, e.g. OpenAI `messages`, are JSON-encoded; null stays null); a missing one is a bad record "
        "(file:line, honours sharding.on_error). Hashing, dedup, balance and token counts use only key/text. "
        "Not for text-file folders.",
    )
    sample: bool = Field(False, description="Build the deterministic sample corpus at `path` if it is missing.")
    sample_kind: Literal["docstrings", "alpaca", "chats", "pairs"] = Field(
        "docstrings",
        description="docstrings: {id, text}; alpaca: {id, instruction, input, output} (fine-tuning); chats: {id, "
        "messages} (OpenAI style: system, user and assistant turns, some multi-turn; train.task sft); pairs: "
        "{id, prompt, chosen, rejected} from the chats, the answer's words reversed as rejected (train.task dpo).",
    )
    style: Literal["auto", "text", "messages", "alpaca", "sharegpt"] = Field(
        "auto",
        description="Record layout. text: `text_field`. With train.task sft, chats: messages = OpenAI "
        "`messages` [{role, content}]; sharegpt = `conversations` [{from: human|gpt|system, value}]; alpaca = "
        "instruction, input, output (+ system). auto: by each record's fields (messages, conversations, "
        "instruction/output, else text).",
    )


class DaskSpec(_Section):
    """A Dask cluster for the shard stage's scan and write tasks (prefect-dask's DaskTaskRunner).

    Output bytes do not depend on it: the same shards as on one machine."""

    address: str | None = Field(None, description="Scheduler of a running cluster, e.g. tcp://10.0.0.2:8786.")
    cluster_class: str | None = Field(
        None, description="Or a cluster to start for the run, e.g. dask_jobqueue.SLURMCluster (pip install it)."
    )
    cluster_kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments of cluster_class.")

    @model_validator(mode="after")
    def _one_way(self) -> DaskSpec:
        if (self.address is None) == (self.cluster_class is None):
            raise ValueError("set exactly one of address (a running scheduler) and cluster_class (one to start)")
        if self.cluster_kwargs and self.cluster_class is None:
            raise ValueError("cluster_kwargs needs cluster_class")
        return self


class ShardingSpec(_Section):
    """Hash sharding: shard = xxhash64(key ‖ salt) mod num_shards, balanced within `tolerance`."""

    num_shards: int = Field(8, gt=0, description="Number of Parquet shards.")
    output: str = Field(".nightloom/shards", description="Local folder or s3:// prefix for shards + manifest.")
    key_field: str | None = Field(None, description="Field used as the hash key; default the text itself.")
    salt: str = Field("nightloom", description="Salt mixed into the hash; change it to reshuffle.")
    balance_by: Literal["rows", "tokens", "bytes"] = Field("tokens", description="What `tolerance` balances.")
    tolerance: float = Field(0.02, gt=0, lt=1, description="Max |x_i - mean| / mean over shards.")
    dedup: bool = Field(True, description="Drop exact duplicate keys after the first.")
    on_error: Literal["fail", "skip"] = Field("fail", description="A bad record: fail the run, or skip it (counted).")
    max_bad_fraction: float = Field(0.01, ge=0, le=1, description="With on_error=skip: fail above this.")
    compression: Literal["zstd", "snappy", "lz4", "none"] = Field(
        "zstd", description="Parquet codec of the shards: zstd (level 1) is ~2.5× smaller than none on text."
    )
    dask: DaskSpec | None = Field(None, description="Run the scan and write tasks on a Dask cluster.")
    heldout: float = Field(
        0.0,
        ge=0,
        description="Held-out documents, never in a training shard: a fraction (< 1) or a count (>= 1), chosen "
        "by hash; written as `heldout.<hash>.parquet` and listed in the manifest (0 = none).",
    )
    near_dup: NearDupSpec | None = Field(
        None, description="Remove near-duplicates (MinHash LSH over word n-grams; one kept per cluster). Off: null."
    )
    filters: FiltersSpec | None = Field(
        None, description="Quality filters (Gopher, C4, FineWeb, length), each counted in the manifest. Off: null."
    )

    @field_validator("heldout")
    @classmethod
    def _heldout(cls, v: float) -> float:
        if v >= 1 and v != int(v):
            raise ValueError(f"a fraction below 1 or a whole count of documents, got {v}")
        return v


class ParallelSpec(_Section):
    """Explicit parallel degrees; leave `parallel: auto` in the spec to let the planner choose. The rules are
    nightloom.parallel.ParallelDims.check's (run at load time when the model is known)."""

    tp: int = Field(1, gt=0, description="Tensor parallel degree.")
    pp: int = Field(1, gt=0, description="Pipeline parallel stages.")
    dp_replicate: int = Field(1, gt=0, description="Replicas (plain data parallel); HSDP's replica groups.")
    dp_shard: int = Field(-1, description="Ranks sharding with FSDP2; -1 = whatever is left of the world size.")
    cp: int = Field(1, gt=0, description="Context parallel (GPU only).")
    ep: int = Field(
        1,
        gt=0,
        description="Expert parallel (mixtures of experts: qwen3_moe, mixtral): experts split over ep of the dp_shard "
        "ranks, tokens sent to them by all_to_all; the experts' FSDP2 over the rest (docs/moe.md).",
    )
    sp: bool = Field(False, description="Sequence parallel with TP (Megatron-SP).")
    micro_batch: int = Field(1, gt=0, description="Sequences per rank per forward pass.")
    virtual_stages: int = Field(1, gt=0, description="Model chunks per pipeline rank (interleaved_1f1b).")
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"] = Field(
        "1f1b",
        description="Pipeline schedule (pp > 1): zbv is the V-shaped zero-bubble schedule (two chunks a rank, "
        "virtual_stages 2; backward split into input and weight passes that fill the bubble).",
    )
    recompute: Literal["none", "selective", "full"] = Field("none", description="Activation recomputation.")
    zero: Literal["fsdp", "zero2"] = Field(
        "fsdp", description="How dp_shard shards: fsdp (ZeRO-3) or zero2 (parameters kept from forward to backward)."
    )
    stages: list[int] | None = Field(
        None,
        description="Transformer layers per pipeline stage (uneven split); the first and last may be 0 (a stage "
        "with the embedding only, one with the head only, as Llama 3 405B ran).",
    )
    reduce_each_micro_batch: bool = Field(
        False,
        description="FSDP2 reduce-scatters the gradients of every micro-batch, not only the last one's: no "
        "unsharded fp32 gradients (4 B/param of a stage) held between micro-batches, one reduce-scatter more per "
        "micro-batch. parallel: auto chooses it where the memory it saves makes a layout fit.",
    )
    offload_layers: int = Field(
        0,
        ge=0,
        description="Each pipeline rank (the whole model without PP) keeps what its first N transformer layers save "
        "for backward in pinned host memory, copied out beside their forward and back one layer ahead of their "
        "backward (recompute: none only). parallel: auto offloads the fewest layers that make a layout fit.",
    )

    @field_validator("zero", mode="before")
    @classmethod
    def _zero(cls, v):
        if v == "none":
            raise ValueError("'none' is not a sharding mode: plain data parallel is dp_replicate: N with dp_shard: 1")
        return v

    @field_validator("dp_shard")
    @classmethod
    def _dp_shard(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"must be >= 1, or -1 for the rest of the world size, got {v}")
        return v

    @model_validator(mode="after")
    def _stages(self) -> ParallelSpec:
        n = self.pp * (self.virtual_stages if self.schedule in ("interleaved_1f1b", "zbv") else 1)
        why = stage_list_errors(self.stages, n, what=f"pp·virtual_stages ({n})") if self.stages is not None else []
        if why:  # the sum is checked against the model's layers later (ParallelDims.check)
            raise ValueError("; ".join(why))
        return self


class XTunerSpec(_Section):
    method: Literal["full", "lora", "qlora"] = Field("lora", description="Every weight, LoRA, or LoRA on 4-bit.")
    base_model: str = Field(
        "", description="Older alias of model.weights (the base model: local Hugging Face folder or s3:// prefix)."
    )
    map_fn: str = Field("alpaca", description="XTuner dataset map function: alpaca, alpaca_zh, openai, default.")
    template: str = Field("default", description="XTuner prompt template name.")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage (0 = plain data parallel).")
    sequence_parallel_size: int = Field(1, gt=0, description="XTuner sequence parallel ranks per sequence.")
    merge_lora: bool = Field(True, description="lora/qlora: also write the base with the adapter merged in.")
    micro_batch: int | None = Field(
        None,
        gt=0,
        description="Sequences per rank per forward pass; default global_batch / world size. A rank accumulates "
        "global_batch / (world size x micro_batch) of them per step, so recovery on fewer ranks keeps each step's "
        "gradient (and the memory a forward needs).",
    )
    build_tiny_base_model: bool = Field(
        False, description="Build a tiny random Llama at base_model on first use (demos and tests only)."
    )
    python: str | None = Field(None, description="Interpreter of the XTuner node env; created when unset.")
    amp: Literal["auto", "fp16", "bf16"] = Field(
        "auto", description="GPU mixed precision for XTuner (auto = bf16); CPU always trains in fp32."
    )


class TrainSpec(_Section):
    """Training hyper-parameters; the same on every backend."""

    backend: Literal["native", "xtuner"] = Field("native", description="nightloom's trainer, or XTuner.")
    task: Literal["pretrain", "sft", "dpo", "grpo"] = Field(
        "pretrain",
        description="pretrain: every token is a label. sft: chat records rendered with the chat template, one "
        "conversation per sequence, the loss over the assistant's tokens only (held-out eval and `nightloom "
        "eval` too); native backend only. dpo: preference pairs (prompt, chosen, rejected), the loss of "
        "train.preference; native backend only. grpo: reinforcement learning with verifiable rewards, completions "
        "sampled and scored by train.grpo's reward functions; native backend only.",
    )
    pack: bool = Field(
        False,
        description="sft: several whole conversations per sequence (greedy first-fit in the shuffled order), "
        "attention block-causal within each and positions restarting per conversation; global_batch then counts "
        "packed sequences. Needs parallel.pp = 1 and cp = 1.",
    )
    group_by_length: bool = Field(
        False,
        description="sft without pack: sort each global batch's conversations by length into micro-batches "
        "(dealt to the DP ranks so each gets short and long ones), so less padding is computed; each "
        "micro-batch is padded to its longest conversation either way. Same rows per step, same loss.",
    )
    steps: int = Field(30, gt=0, description="Optimizer steps to train.")
    seq_len: int = Field(128, gt=0, description="Tokens per sequence.")
    global_batch: int = Field(8, gt=0, description="Sequences per optimizer step across all DP ranks.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate: linear warmup to it, then cosine decay.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="The decay ends at lr × this.")
    warmup_steps: int = Field(3, ge=0, description="Linear warmup steps from 0 to lr.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled weight decay (AdamW).")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this.")
    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="adamw (betas 0.9, 0.95), or plain sgd: its update scales with the gradient."
    )
    seed: int = Field(1234, description="Seed of the initial weights and the data order.")
    precision: Literal["auto", "fp32", "bf16", "fp8"] = Field(
        "auto",
        description="auto = bf16 on GPU, fp32 on CPU. fp8 (GPU only, torchao): the block linears run float8 "
        "matmuls (train.fp8_recipe) with bf16 weights and fp32 master state; FSDP2 all-gathers them in float8.",
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description="train.precision fp8: torchao's scaling, one scale per tensor (FSDP2 all-gathers float8) or "
        "per row (more accurate, bf16 all-gathers).",
    )
    loss_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="Cross-entropy fused with the output head in chunks of this many tokens, so the whole "
        "batch's fp32 logits never exist (where the head is whole on a rank: pp = tp = cp = 1); 0 = plain loss.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each transformer block (after TP, before FSDP2, as torchtitan; any layout, "
        "but not parallel.tp > 1 with parallel.recompute full/selective); the first step compiles (about 30-90 s "
        "per block shape on a CPU), the loss curve is eager's.",
    )
    checkpoint_every: int = Field(0, ge=0, description="Save a DCP checkpoint every K steps (0 = only at end).")
    async_checkpoint: bool = Field(
        False,
        description="Periodic checkpoints with DCP's async_save: the state is copied to host memory (a second "
        "copy there, which the planner does not count) and written while the next steps run; the final and "
        "a preemption save are waited for.",
    )
    collective_timeout_s: int = Field(120, gt=0, description="A collective stuck this long fails the attempt.")
    metrics_port: int | None = Field(None, description="Prometheus endpoint base port (rank r uses port+r).")
    export: Literal["auto", "hf", "none"] = Field(
        "auto",
        description="When training completes, write `<run_dir>/export/` (Hugging Face config, safetensors, "
        "tokenizer) before the validation gates; auto = hf when the model comes from a Hugging Face config.",
    )
    lora: LoraSpec | None = Field(
        None,
        description="Train low-rank adapters instead of every weight (native backend; for XTuner use "
        "train.xtuner.method).",
    )
    xtuner: XTunerSpec | None = Field(None, description="XTuner settings; required when backend is xtuner.")
    preference: PreferenceSpec | None = Field(
        None, description="train.task dpo: the preference loss and its reference (defaults as TRL's when absent)."
    )
    grpo: GRPOSpec | None = Field(
        None, description="train.task grpo: rollouts, reward functions and the GRPO loss (defaults as TRL's)."
    )

    @model_validator(mode="before")
    @classmethod
    def _grpo_batch(cls, data):
        return grpo_global_batch(data)  # train.task grpo: a step's completions (nightloom/spec/grpo.py)

    @field_validator("pack")
    @classmethod
    def _pack(cls, v: bool, info):
        if v and info.data.get("task") != "sft":
            raise ValueError("packing places whole conversations in a sequence: it needs train.task: sft")
        return v


#: Fields added since the ledger first keyed runs by spec hash, with their defaults: left out of the hash while
#: they hold them (RunSpec.spec_hash). Add every new field here with its default.
HASH_NEUTRAL_DEFAULTS: dict[tuple[str, str], object] = {
    ("train", "task"): "pretrain",
    ("dataset", "style"): "auto",
    ("model", "chat_template"): None,
    ("train", "lora"): None,
    ("parallel", "ep"): 1,
    ("parallel", "reduce_each_micro_batch"): False,
    ("parallel", "offload_layers"): 0,
    ("train", "pack"): False,
    ("train", "group_by_length"): False,
    ("recovery", "max_preemptions"): 10,
    ("recovery", "preempt_signal"): None,
    ("recovery", "preempt_grace_s"): 120,
    ("train", "async_checkpoint"): False,
    ("train", "compile"): False,
    ("train", "loss_chunk_tokens"): 1024,
    ("train", "fp8_recipe"): "tensorwise",
    ("train", "preference"): None,
    ("train", "grpo"): None,
    ("train.grpo", "engine"): "native",
    ("train.grpo", "vllm"): None,
    ("validate", "min_reward_accuracy"): None,
    ("validate", "min_reward_gain"): None,
    ("train.lora", "quantize"): None,
    ("train.lora", "double_quant"): True,
    ("train.lora", "compute_dtype"): "auto",
    ("train.lora", "use_rslora"): False,
    ("train.lora", "use_dora"): False,
    ("train.lora", "merged_export"): None,
    ("train.lora", "modules_to_save"): None,
    ("train.lora", "trainable_token_indices"): None,
    ("validate", "benchmarks"): None,
    ("validate.benchmarks", "backend"): "auto",
    ("sharding", "near_dup"): None,
    ("sharding", "filters"): None,
    ("", "track"): TrackSpec().model_dump(mode="json"),  # "": a field of the spec itself; trackers off
}


class RunSpec(_Section):
    """One declarative run: what to train, on what data, where, how, and what counts as success."""

    name: str = Field(..., description="Run name: letters, digits, '-', '_', '.'.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="What to train: the model and its tokenizer.")
    dataset: DatasetSpec = Field(..., description="The training corpus.")
    sharding: ShardingSpec = Field(default_factory=ShardingSpec, description="How the corpus is sharded.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Where training runs.")
    parallel: Annotated[Literal["auto"], WithJsonSchema({"type": "string", "enum": ["auto"]})] | ParallelSpec = Field(
        "auto",
        description="auto: the planner chooses the layout (TP, PP, DP, CP, sequence parallel, ZeRO/FSDP) that fits "
        "memory and is fastest for the cluster; or explicit degrees (tp, pp, dp, ...), checked against the model.",
    )
    train: TrainSpec = Field(default_factory=TrainSpec, description="Training hyper-parameters.")
    validate_: ValidateSpec = Field(default_factory=ValidateSpec, alias="validate", description="Gates to pass.")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="Windows, prices, budget.")
    storage: StorageSpec = Field(default_factory=StorageSpec, description="Where run folders go.")
    ledger: LedgerSpec = Field(default_factory=LedgerSpec, description="The run ledger's database.")
    recovery: RecoverySpec = Field(default_factory=RecoverySpec, description="Relaunching after failures.")
    track: TrackSpec = Field(
        default_factory=TrackSpec,
        description="Experiment trackers (MLflow, W&B, TensorBoard) that get every step's metrics, the resolved "
        "spec and plan, the verdicts, plots and summary; `[mlflow, wandb]` turns them on with their defaults.",
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", v):
            raise ValueError(f"must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> RunSpec:
        if self.train.backend == "xtuner" and self.train.xtuner is None:
            raise ValueError("train.xtuner: required when train.backend is 'xtuner'")
        alias = self.train.xtuner.base_model if self.train.xtuner is not None else ""
        if alias and self.model.weights and alias.rstrip("/") != self.model.weights.rstrip("/"):
            raise ValueError(
                f"model.weights ({self.model.weights!r}) and train.xtuner.base_model ({alias!r}) name different "
                "base models; set model.weights only (train.xtuner.base_model is its older alias)"
            )
        lora = self.train.lora
        if lora is not None and self.train.backend != "native":
            raise ValueError("train.lora: native backend only (XTuner's LoRA is train.xtuner.method: lora)")
        if lora is not None and isinstance(self.parallel, ParallelSpec) and lora.rank % self.parallel.tp:
            raise ValueError(
                f"train.lora.rank: {lora.rank} is not a multiple of parallel.tp ({self.parallel.tp}): each adapter "
                "is split over the TP ranks as its base linear is"
            )
        p = self.parallel
        pref_error = layout_error(self.train.task, self.train.preference, lora, self.train.backend, p)
        if pref_error:
            raise ValueError(pref_error)
        grpo_error = grpo_layout_error(self.train.task, self.train.grpo, lora, self.train.backend, p)
        if grpo_error:
            raise ValueError(grpo_error)
        if lora is not None and lora.quantize and p != "auto" and (p.tp > 1 or p.pp > 1):
            raise ValueError(
                f"train.lora.quantize: a {lora.quantize} base runs in one process or under FSDP2 (dp_shard); "
                f"parallel.tp {p.tp} and parallel.pp {p.pp} must be 1 (TP/PP over a quantized base are not done)"
            )
        merged = lora is not None and (lora.merged_export or (lora.merged_export is None and not lora.quantize))
        if lora is not None and not merged and self.validate_.benchmarks is not None:
            raise ValueError(
                "validate.benchmarks: lm-eval scores the merged export, which this LoRA run does not write "
                "(train.lora.merged_export is off, the default with quantize): set train.lora.merged_export: true"
            )
        beta = self.train.grpo.beta if self.train.grpo is not None else 0.0
        if (lora_error := lora_layout_error(lora, p, self.train.task, beta)) is not None:
            raise ValueError(lora_error)
        if self.train.pack and p != "auto" and (p.pp > 1 or p.cp > 1):
            raise ValueError(
                f"train.pack: packed sequences need parallel.pp = 1 and parallel.cp = 1 (got pp {p.pp}, cp {p.cp}): "
                "the pipeline schedule and ring attention take no per-sequence document mask"
            )
        if self.train.compile and p != "auto" and p.tp > 1 and p.recompute != "none":
            raise ValueError(
                f"train.compile: true with parallel.tp {p.tp} and parallel.recompute {p.recompute!r} is not supported: "
                "torch 2.13 cannot compile a recomputed block under TP; set parallel.recompute: none, or compile: false"
            )
        xs = self.train.xtuner
        if self.train.backend == "xtuner" and xs is not None:
            micro_batches_per_step(
                self.train.global_batch, self.world_size, xs.micro_batch, xs.zero_stage, xs.sequence_parallel_size
            )
        return self

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    def spec_hash(self) -> str:
        """Stable hash of the spec's content (ledger key: same spec ⇒ same hash). A field added after ledgers began
        keying runs by it is left out while it holds its default, so a spec written before keeps its hash (its
        ledger rows and `golden.from_ledger` still match)."""
        data = self.model_dump(mode="json", by_alias=True)
        for (section, key), default in HASH_NEUTRAL_DEFAULTS.items():
            part = data
            for name in filter(None, section.split(".")):  # "train.lora": a nested section; "": the spec
                part = part.get(name) if isinstance(part, dict) else None
            if isinstance(part, dict) and part.get(key, default) == default:  # parallel may be "auto"
                part.pop(key, None)
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def resolved(self, base_dir: Path) -> RunSpec:
        """A copy whose local relative paths are absolute, against `base_dir`."""
        spec = self.model_copy(deep=True)

        def fix(p: str | None) -> str | None:
            if p is None or "://" in p or Path(p).expanduser().is_absolute():
                return p
            return str((base_dir / p).resolve())

        spec.dataset.path = fix(spec.dataset.path)
        spec.sharding.output = fix(spec.sharding.output)
        spec.storage.root = fix(spec.storage.root)
        spec.model.config = fix(spec.model.config)
        spec.model.weights = fix(spec.model.weights)
        spec.model.chat_template = fix(spec.model.chat_template)
        if spec.model.config is None and spec.model.weights is not None and "://" not in spec.model.weights:
            spec.model.config = str(Path(spec.model.weights) / "config.json")
        spec.model.tokenizer.path = fix(spec.model.tokenizer.path)
        spec.validate_.golden.path = fix(spec.validate_.golden.path)
        spec.validate_.eval_data = fix(spec.validate_.eval_data)
        if spec.validate_.benchmarks is not None:
            spec.validate_.benchmarks.include_path = fix(spec.validate_.benchmarks.include_path)
        if spec.ledger.url.startswith("sqlite:///") and not spec.ledger.url.startswith("sqlite:////"):
            spec.ledger.url = "sqlite:///" + fix(spec.ledger.url[len("sqlite:///") :])
        if spec.train.xtuner is not None:
            spec.train.xtuner.base_model = fix(spec.train.xtuner.base_model) or ""
        for reward in spec.train.grpo.rewards if spec.train.grpo is not None else []:  # file.py:function
            target, _, func = reward.fn.rpartition(":")
            if target.endswith(".py"):
                reward.fn = f"{fix(target)}:{func}"
        return spec
