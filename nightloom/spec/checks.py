"""The spec checks that need more than the schema: the model's config and weights, the tokenizer against the
model's vocabulary, an explicit layout against the model and the world size, files that must exist, catalog
names. They run on the raw mapping (not the validated model), so they are reported together with the schema's
errors, each as (field path, reason), before anything is rented.
"""

from __future__ import annotations

import dataclasses
import json
import os
from importlib.util import find_spec
from pathlib import Path

from pydantic import ValidationError

from nightloom.benchmarks.catalog import spec_errors as benchmark_errors
from nightloom.catalog import GPUS, MODELS
from nightloom.chat import CHAT_STYLES, ChatError, detect_style, prompt_messages, template_text
from nightloom.families import families, family_for
from nightloom.hf.config import config_path, shape_from_hf_config
from nightloom.model_resolver import shape_from_name_or_config
from nightloom.parallel import LayoutError, ParallelDims, moe_degree_errors
from nightloom.rewards.resolve import reward_errors
from nightloom.shape import ModelShape
from nightloom.spec import ParallelSpec, TokenizerSpec
from nightloom.spec.grpo import engine_errors
from nightloom.spec.tracking import track_errors
from nightloom.tokenizer import TokenizerError, load_tokenizer
from nightloom.xtuner_families import xtuner_refusal

FieldError = tuple[tuple, str]


def _get(data: dict, *path, default=None):
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def _model_errors(data: dict, local) -> list[FieldError]:
    """model.config parses (strictly: a field the native model cannot compute is named) and model.weights holds
    safetensors; a demo whose weights are built on first use is checked when they exist."""
    config, weights = _get(data, "model", "config"), _get(data, "model", "weights")
    build = _get(data, "model", "build_demo_weights") is True
    if config is None and isinstance(weights, str) and "://" in weights:
        return [(("model", "config"), "required when model.weights is an s3:// prefix")]
    wdir = local(weights)
    cfg = local(config) if config is not None else (wdir / "config.json" if wdir is not None else None)
    errs: list[FieldError] = []
    field = ("model", "config") if config is not None else ("model", "weights")
    if cfg is not None and not (build and not config_path(cfg).exists()):
        if not config_path(cfg).is_file():
            errs.append((field, f"file not found: {config_path(cfg)}"))
        else:
            try:
                shape_from_hf_config(cfg)
            except ValueError as e:
                errs.append((field, str(e)))
    if wdir is not None and not (build and not wdir.exists()):
        if not wdir.is_dir():
            errs.append((("model", "weights"), f"folder not found: {wdir}"))
        elif not any(wdir.glob("*.safetensors")):
            errs.append((("model", "weights"), f"no *.safetensors files in {wdir}"))
    if build and wdir is None:
        errs.append((("model", "build_demo_weights"), "needs a local model.weights folder"))
    return errs


#: mixture-of-experts families the native trainer runs (train/moe.py); others are read for planning only
TRAINED_MOE = tuple(t for f in families() if f.moe and f.trained for t in f.model_types)


def _moe_errors(data: dict, local) -> list[FieldError]:
    """Mixture-of-experts models the trainers cannot run, named on the field that chose the model, and the layouts
    qwen3_moe, mixtral and deepseek_v3 do not train with (tp, pp, cp > 1; ep beside dp_replicate), on the parallel
    field; LoRA on deepseek_v3's latent attention, on train.lora."""
    shape = _raw_shape(data, local)
    if shape is None or not shape.moe:
        return []
    field = ("model", "config") if _get(data, "model", "config") is not None else ("model", "name")
    if _get(data, "model", "config") is None and _get(data, "model", "weights") is not None:
        field = ("model", "weights")
    family = family_for(shape.arch)
    if family is None or not (family.moe and family.trained):
        return [
            (
                field,
                f"{shape.name} is a mixture-of-experts model ({shape.arch}: {shape.num_experts} experts, top-"
                f"{shape.experts_per_token}): training {shape.arch} is not supported yet ({', '.join(TRAINED_MOE)} "
                "are); `nightloom plan` and `nightloom cost` read it",
            )
        ]
    degrees = {}
    for name in ("tp", "pp", "cp", "ep", "dp_replicate"):
        v = _get(data, "parallel", name, default=1)
        degrees[name] = v if isinstance(v, int) and not isinstance(v, bool) else 1  # the schema names a bad one
    errs: list[FieldError] = [(("parallel", k), why) for k, why in moe_degree_errors(shape, **degrees)]
    if shape.mla and _get(data, "train", "lora") is not None:
        errs.append(
            (
                ("train", "lora"),
                f"{shape.name} ({shape.arch}) uses multi-head latent attention: LoRA on it is not supported yet "
                "(full fine-tuning is)",
            )
        )
    return errs


def _quantize_errors(data: dict, local) -> list[FieldError]:
    """train.lora.quantize: bitsandbytes' limits on every decoder linear (train/qlora.check_dims at load): in a
    multiple of 64 (whole blocks per row, so rows shard) and out a multiple of 32 (its CPU kernel); no MoE yet."""
    if not _get(data, "train", "lora", "quantize"):
        return []
    shape, field = _raw_shape(data, local), ("train", "lora", "quantize")
    if shape is None:
        return []
    if shape.moe:
        return [(field, f"{shape.name} is a mixture of experts: its experts are not quantized yet")]
    q, kv, h, f = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.ffn_hidden
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "up_proj": (h, f)}
    bad = [f"{n} {i} -> {o}" for n, (i, o) in (dims | {"down_proj": (f, h)}).items() if i % 64 or o % 32]
    if not bad:
        return []
    return [(field, f"{shape.name}: a quantized linear needs in a multiple of 64 and out of 32; {', '.join(bad)}")]


def _token_rows_errors(data: dict, local) -> list[FieldError]:
    """train.lora.trainable_token_indices against the model (train/lora.train_beside): each id below its
    vocabulary, and an untied embedding (a tied one is the head too: modules_to_save trains it)."""
    ids = _get(data, "train", "lora", "trainable_token_indices")
    shape = _raw_shape(data, local) if isinstance(ids, list) and ids else None
    if shape is None:
        return []
    field = ("train", "lora", "trainable_token_indices")
    if shape.tied_embeddings:
        return [(field, f"{shape.name} ties its head to the embedding; use modules_to_save: [embed_tokens]")]
    past = [i for i in ids if isinstance(i, int) and i >= shape.vocab]
    return [(field, f"ids {past} are not below {shape.name}'s vocabulary ({shape.vocab})")] if past else []


def _raw_shape(data: dict, local) -> ModelShape | None:
    """The model of a spec not yet validated, through the one resolver (model.config, else the config.json in a
    local model.weights, else the catalog's model.name); None when it cannot be read (its own check says why)."""
    config, weights = local(_get(data, "model", "config")), local(_get(data, "model", "weights"))
    config = config if config is not None else (weights / "config.json" if weights is not None else None)
    if config is None and _get(data, "model", "config") is not None:
        return None  # an s3:// config is read when the run fetches it
    try:
        return shape_from_name_or_config(config if config is not None else _get(data, "model", "name", default="tiny"))
    except (OSError, ValueError, KeyError):
        return None


def semantic_errors(data: dict, base_dir: Path) -> list[FieldError]:
    """Checks that need the filesystem or the catalog: (field path, reason), before anything is rented.

    They read the raw mapping (not the validated model) so they are reported together with schema errors."""

    def local(p) -> Path | None:
        if not isinstance(p, str) or "://" in p:
            return None
        q = Path(p).expanduser()
        return q if q.is_absolute() else base_dir / q

    errs: list[FieldError] = []
    name, config = _get(data, "model", "name", default="tiny"), _get(data, "model", "config")
    if config is None and isinstance(name, str) and name not in MODELS:
        errs.append((("model", "name"), f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}"))
    errs += _model_errors(data, local)
    errs += _moe_errors(data, local)
    errs += _quantize_errors(data, local)
    errs += _token_rows_errors(data, local)
    errs += _tokenizer_errors(data, local)
    errs += _chat_errors(data, local)
    task, pack = _get(data, "train", "task", default="pretrain"), _get(data, "train", "pack", default=False)
    if _get(data, "train", "group_by_length") is True and (task != "sft" or pack is True):
        errs.append((("train", "group_by_length"), "groups unpacked conversations: needs task: sft, pack: false"))
    errs += _xtuner_family_errors(data, local)
    every, eval_data = _get(data, "validate", "eval_every", default=0), _get(data, "validate", "eval_data")
    if isinstance(every, int) and every > 0 and not eval_data and not _get(data, "sharding", "heldout", default=0):
        errs.append((("validate", "eval_every"), "needs a held-out split (sharding.heldout) or validate.eval_data"))
    if local(eval_data) is not None and not local(eval_data).is_file():
        errs.append((("validate", "eval_data"), f"file not found: {local(eval_data)}"))
    errs += benchmark_errors(data, local)
    errs += track_errors(data, dict(os.environ))  # an MLflow tracker with no server named anywhere
    if task == "grpo":  # each reward function imported and its signature checked (nightloom/rewards/resolve.py)
        rewards = _get(data, "train", "grpo", "rewards")
        errs += [(("train", "grpo", "rewards", str(i), "fn"), why) for i, why in reward_errors(rewards, base_dir)]
        errs += _grpo_chat_errors(data, local)
        errs += engine_errors(data, find_spec("vllm") is not None)  # train.grpo.engine: vllm (spec/grpo.py)
    gpu = _get(data, "cluster", "gpu_type", default="cpu")
    if isinstance(gpu, str) and gpu != "cpu" and gpu not in GPUS:
        errs.append((("cluster", "gpu_type"), f"unknown GPU {gpu!r}; known: cpu, {', '.join(sorted(GPUS))}"))
    dpath = local(_get(data, "dataset", "path"))
    if dpath is not None and _get(data, "dataset", "sample") is not True and not dpath.exists():
        errs.append((("dataset", "path"), f"not found: {dpath}"))
    nodes, per = _get(data, "cluster", "nodes", default=2), _get(data, "cluster", "gpus_per_node", default=2)
    errs += _parallel_errors(data, local, nodes, per)
    provider = _get(data, "cluster", "provider", default="local")
    if (provider.get("kind") if isinstance(provider, dict) else provider) == "ssh":
        where = ("cluster", "provider", "hosts") if isinstance(provider, dict) else ("cluster", "ssh", "hosts")
        hosts = _get(data, *where, default=[]) or []
        active = [h for h in hosts if isinstance(h, dict) and not h.get("spare")]
        if isinstance(nodes, int) and len(active) < nodes:
            errs.append((where, f"{len(active)} non-spare hosts for cluster.nodes={nodes}"))
    return errs


def _parallel_errors(data: dict, local, nodes, per) -> list[FieldError]:
    """An explicit `parallel:` section against the world size and the model: ParallelDims.resolve fills
    dp_shard=-1, ParallelDims.check gives the reasons (the rules the planner and the trainer apply)."""
    par = _get(data, "parallel")
    if not isinstance(par, dict) or not all(isinstance(x, int) and x > 0 for x in (nodes, per)):
        return []
    try:
        p = ParallelSpec.model_validate(par)
    except ValidationError:
        return []  # the schema errors are reported already
    try:
        dims = ParallelDims.resolve(
            nodes * per,
            tp=p.tp,
            pp=p.pp,
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            cp=p.cp,
            sp=p.sp,
            virtual_stages=p.virtual_stages,
            schedule=p.schedule,
            recompute=p.recompute,
            zero=p.zero,
            stages=tuple(p.stages) if p.stages else None,
        )
    except LayoutError as e:
        return [(("parallel",), f"{e} (cluster.nodes·cluster.gpus_per_node)")]
    shape = _raw_shape(data, local)
    if shape is None:
        return []  # reported under model.* (or built on first use)
    seq = _get(data, "train", "seq_len", default=128)
    gb = _get(data, "train", "global_batch", default=8)
    if not (isinstance(seq, int) and isinstance(gb, int)):
        return []
    # micro_batch is pinned, grad_accum follows from the global batch (as the planner sets it)
    per_rank = gb // dims.dp if gb % dims.dp == 0 else 0
    accum = per_rank // p.micro_batch if per_rank and per_rank % p.micro_batch == 0 else 0
    if accum:
        dims = dataclasses.replace(dims, micro_batch=p.micro_batch, grad_accum=accum)
    else:
        return [
            (
                ("parallel", "micro_batch"),
                f"train.global_batch ({gb}) is not divisible by micro_batch ({p.micro_batch}) · dp ({dims.dp})",
            )
        ]
    return [(("parallel",), why) for why in dims.check(shape, seq, gb)]


def _tokenizer_errors(data: dict, local) -> list[FieldError]:
    """model.tokenizer: the path exists, the tokenizer loads, and the model's vocab covers its ids."""
    raw = _get(data, "model", "tokenizer", default="bytes")
    try:
        tspec = TokenizerSpec.coerce(raw)
    except (ValidationError, ValueError):
        return []  # reported by the schema check
    if tspec.path is not None and local(tspec.path) is not None:
        tspec = tspec.model_copy(update={"path": str(local(tspec.path))})
    if tspec.path is not None and tspec.train_vocab is None and not Path(tspec.path).expanduser().exists():
        return [(("model", "tokenizer"), f"not found: {tspec.path}")]
    if tspec.train_vocab is not None and not (Path(tspec.path or "") / "tokenizer.json").is_file():
        tok_vocab, what = tspec.train_vocab, f"the BPE trained on first use (train_vocab {tspec.train_vocab})"
    else:
        try:
            tok = load_tokenizer(tspec)
        except (TokenizerError, OSError) as e:
            return [(("model", "tokenizer"), str(e))]
        tok_vocab, what = tok.vocab_size, f"tokenizer {tspec.path or 'bytes'}"
    vocab = _get(data, "model", "vocab")
    if vocab == "tokenizer":
        return []
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        model_vocab, who = vocab, "model.vocab"
    else:
        shape = _raw_shape(data, local)
        if shape is None:
            return []  # model errors are reported by their own check (or the weights are built on first use)
        model_vocab, who = shape.vocab, f"model {shape.name}"
    if model_vocab < tok_vocab:
        return [
            (
                ("model", "tokenizer"),
                f"{who} has {model_vocab} embedding rows but {what} has {tok_vocab} ids: the vocabulary does not "
                "cover the tokenizer (set model.vocab: tokenizer, a number >= the tokenizer's, or another model)",
            )
        ]
    return []


def _first_record(path: Path | None, fmt) -> dict | None:
    """The dataset's first good record (local JSONL, Parquet or Arrow), or None when it cannot be read cheaply
    (the shard stage then reports what is wrong with it)."""
    if path is None or not path.exists():
        return None
    from nightloom.sharding.scan_chats import first_record
    from nightloom.sharding.sources import list_sources

    try:
        sources = list_sources(str(path), fmt if isinstance(fmt, str) else "auto")
        src = next((s for s in sources if s.format != "text"), None)
        return first_record(Path(src.uri), src.format) if src is not None else None
    except Exception:  # noqa: BLE001 - a peek only: any problem is the shard stage's to report, with file:line
        return None


def _chat_errors(data: dict, local) -> list[FieldError]:
    """train.task sft and dataset.style: sft runs natively on chat records, with a Hugging Face tokenizer whose
    chat template (its own, or model.chat_template) renders them; chat records are not pretraining text."""
    task, style = _get(data, "train", "task", default="pretrain"), _get(data, "dataset", "style", default="auto")
    if task not in ("pretrain", "sft", "dpo") or style not in ("auto", "text", *CHAT_STYLES):
        return []  # the schema reports it
    if task not in ("sft", "dpo"):  # dpo: preference pairs rendered with the same template (nightloom/chat_pairs.py)
        if style in CHAT_STYLES:
            return [(("dataset", "style"), f"{style} records are chats, which train.task: sft trains on")]
        return []
    if _get(data, "train", "backend", default="native") != "native":
        return [(("train", "task"), "sft runs on the native backend (XTuner applies its own map_fn and template)")]
    try:
        tspec = TokenizerSpec.coerce(_get(data, "model", "tokenizer", default="bytes"))
    except (ValidationError, ValueError):
        return []
    folder = local(tspec.path)
    if tspec.train_vocab is not None and folder is not None and not (folder / "tokenizer.json").is_file():
        return []  # trained on first use for the chats, with ChatML's specials and template (tokenizer.py)
    if tspec.is_bytes or tspec.kind not in ("auto", "hf") or folder is None:
        what = tspec.path or "bytes"
        return [
            (
                ("model", "tokenizer"),
                f"train.task sft renders chats with transformers' apply_chat_template: a Hugging Face tokenizer "
                f"folder with a chat template is needed, got {what}",
            )
        ]
    if not folder.is_dir():
        return []  # reported by the tokenizer check
    template = _get(data, "model", "chat_template")
    try:
        template_text(folder, local(template) if template is not None else None)
    except ChatError as e:
        return [(("model", "chat_template"), str(e).removeprefix("model.chat_template: "))]
    if style == "auto" and task == "sft":
        first = _first_record(local(_get(data, "dataset", "path")), _get(data, "dataset", "format"))
        if first is not None and detect_style(first) == "text":
            return [
                (
                    ("dataset", "style"),
                    f"train.task sft reads chat records; the first record has none of messages, conversations, "
                    f"instruction/output (fields: {', '.join(sorted(first))})",
                )
            ]
    return []


def _grpo_chat_errors(data: dict, local) -> list[FieldError]:
    """train.task grpo: prompts through the chat template (train.grpo.chat_template true, or a chat-shaped dataset:
    its first record's text field a messages list, or that list JSON-encoded) need a Hugging Face tokenizer folder with a chat template."""
    setting = _get(data, "train", "grpo", "chat_template")
    text_field = _get(data, "dataset", "text_field", default="text")
    first = _first_record(local(_get(data, "dataset", "path")), _get(data, "dataset", "format"))
    chat = isinstance(first, dict) and prompt_messages(first.get(text_field)) is not None
    if setting is False and chat:
        return [(("train", "grpo", "chat_template"), f"false, but the dataset's {text_field!r} is a messages list")]
    if setting is not True and not chat:
        return []
    where = ("train", "grpo", "chat_template") if setting is True else ("dataset", "text_field")
    why = "renders prompts with transformers' apply_chat_template: a tokenizer folder with a chat template is needed"
    try:
        tspec = TokenizerSpec.coerce(_get(data, "model", "tokenizer", default="bytes"))
    except (ValidationError, ValueError):
        return []  # the tokenizer check reports it
    folder = local(tspec.path)
    lead = f"{text_field!r} holds messages lists (chats): train.grpo" if chat else "train.grpo"
    if tspec.is_bytes or tspec.kind not in ("auto", "hf") or folder is None or not folder.is_dir():
        return [(where, f"{lead} {why}, got {tspec.path or 'bytes'}")]
    template = _get(data, "model", "chat_template")
    try:
        template_text(folder, local(template) if template is not None else None)
    except ChatError as e:
        return [(where, f"{lead} {why}: {str(e).removeprefix('model.chat_template: ')}")]
    return []


def _xtuner_family_errors(data: dict, local) -> list[FieldError]:
    """train.backend xtuner with a model family transformers 4.48 (XTuner's pin) cannot load: named, with the
    native trainer as the way to fine-tune it (nightloom/xtuner_families.py)."""
    if _get(data, "train", "backend", default="native") != "xtuner":
        return []
    alias = _get(data, "train", "xtuner", "base_model", default="")
    weights = _get(data, "model", "weights") or alias
    folder = local(weights)
    if folder is None or not (folder / "config.json").is_file():
        return []  # not built yet (a demo), remote, or missing: the base-model check names it
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return []
    why = xtuner_refusal(model_type)
    field = ("model", "weights") if _get(data, "model", "weights") else ("train", "xtuner", "base_model")
    return [] if why is None else [(field, why)]
