"""Render the XTuner config from a template kept in the repo, and check the inputs before anything launches.

Rendering never uses `--cfg-options` (packaged configs bake values into nested dicts and cannot drop keys):
each `{{name}}` in `templates/sft_<profile>.py.tmpl` becomes `repr(value)`, or the bare identifier for the few
names typed `Ident`. Unknown or unused placeholders are errors. Checks run in the orchestrator's interpreter
(no xtuner import): a bad spec fails here, naming the field path and the file, before any rank starts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nightloom.spec.micro_batch import micro_batches_per_step
from nightloom.xtuner_families import xtuner_refusal

TEMPLATES = Path(__file__).resolve().parent / "templates"
STATS_FILE = "nightloom_stats.json"  # written by node_wrapper.py prepare next to the processed dataset


class XTunerConfigError(ValueError):
    """Input that cannot train: the message names the spec field path and the offending file or value."""


@dataclass(frozen=True)
class MapFn:
    """An XTuner dataset map function and the columns it reads."""

    name: str  # attribute of xtuner.dataset.map_fns
    columns: tuple[str, ...]
    template: bool = True  # apply the prompt template (pretrain: no)


# The map functions nightloom accepts (xtuner 0.2.0 xtuner/dataset/map_fns/dataset_map_fns/); a test checks
# each name exists in the env. Keys are the spec's `train.xtuner.map_fn`; `<key>_map_fn` is accepted too.
MAP_FNS: dict[str, MapFn] = {
    "alpaca": MapFn("alpaca_map_fn", ("instruction", "input", "output")),
    "alpaca_zh": MapFn("alpaca_zh_map_fn", ("instruction_zh", "input_zh", "output_zh")),
    "openai": MapFn("openai_map_fn", ("messages",)),
    "default": MapFn("default_map_fn", ("input", "output")),
    "pretrain": MapFn("pretrain_map_fn", ("text",), template=False),
    "oasst1": MapFn("oasst1_map_fn", ("text",)),
    "code_alpaca": MapFn("code_alpaca_map_fn", ("prompt", "completion")),
    "tiny_codes": MapFn("tiny_codes_map_fn", ("prompt", "response")),
    "openorca": MapFn("openorca_map_fn", ("system_prompt", "question", "response")),
    "wizardlm": MapFn("wizardlm_map_fn", ("conversations",)),
    "arxiv": MapFn("arxiv_map_fn", ("abstract", "title")),
}

# xtuner.utils.PROMPT_TEMPLATE keys in xtuner 0.2.0 (a test checks them against the env).
PROMPT_TEMPLATES = frozenset(
    {
        "baichuan2_chat",
        "baichuan_chat",
        "chatglm2",
        "chatglm3",
        "code_llama_chat",
        "cohere_chat",
        "deepseek_coder",
        "deepseek_moe",
        "deepseek_v2",
        "deepseekcoder",
        "default",
        "gemma",
        "internlm2_chat",
        "internlm_chat",
        "llama2_chat",
        "llama3_chat",
        "minicpm",
        "minicpm3",
        "mistral",
        "mixtral",
        "moss_sft",
        "phi3_chat",
        "qwen_chat",
        "vicuna",
        "wizardcoder",
        "wizardlm",
        "zephyr",
    }
)

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class Ident(str):
    """A template value rendered as a bare Python identifier (validated), not as a repr."""

    def __new__(cls, v: str) -> Ident:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise XTunerConfigError(f"not a Python identifier: {v!r}")
        return super().__new__(cls, v)


@dataclass(frozen=True)
class RenderInputs:
    """Everything the template needs, already checked; `render_config` turns it into a config file."""

    profile: Literal["cpu", "gpu"]
    method: Literal["full", "lora", "qlora"]
    base_model: str
    data_files: list[str]
    data_format: str
    map_fn: MapFn
    template: str
    work_dir: str
    processed_dir: str
    hf_cache_dir: str
    max_length: int
    batch_size: int  # per rank per optimizer step
    max_iters: int
    warmup_iters: int
    lr: float
    min_lr_ratio: float
    weight_decay: float
    max_norm: float
    save_steps: int
    seed: int
    dist_timeout_s: int
    pack_to_max_length: bool = True
    save_total_limit: int = 2
    map_num_proc: int = 1
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    amp_dtype: Literal["float16", "bfloat16"] = "bfloat16"
    sequence_parallel_size: int = 1
    micro_batches: int = 1  # forward/backward passes per rank per step (nightloom_micro.MicroBatchDDP)
    sampler_pad_to: int = 0  # ranks x micro_batches: the epoch is padded as for that many ranks (0: this run's)
    tokenizer_path: str | None = None  # a Hugging Face tokenizer folder (model.tokenizer.path); None = base_model's
    extra: dict = field(default_factory=dict)

    def values(self) -> dict[str, object]:
        v: dict[str, object] = {
            "method": self.method,
            "base_model": self.base_model,
            "tokenizer_path": self.tokenizer_path or self.base_model,
            "data_format": self.data_format,
            "data_files": list(self.data_files),
            "hf_cache_dir": self.hf_cache_dir,
            "processed_dir": self.processed_dir,
            "work_dir": self.work_dir,
            "map_fn": Ident(self.map_fn.name),
            "map_fn_name": self.map_fn.name,
            "template": Ident(self.template),
            "template_name": self.template,
            "use_template": self.map_fn.template,
            "max_length": self.max_length,
            "pack_to_max_length": self.pack_to_max_length,
            "map_num_proc": self.map_num_proc,
            "batch_size": self.batch_size,
            "micro_batches": self.micro_batches,
            "sampler_pad_to": self.sampler_pad_to,
            "max_iters": self.max_iters,
            "warmup_iters": self.warmup_iters,
            "lr": self.lr,
            "min_lr_ratio": self.min_lr_ratio,
            "weight_decay": self.weight_decay,
            "max_norm": self.max_norm,
            "save_steps": self.save_steps,
            "save_total_limit": self.save_total_limit,
            "seed": self.seed,
            "lora_r": self.lora_r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "dist_timeout_s": self.dist_timeout_s,
        }
        if self.profile == "gpu":
            v.update(
                amp_dtype=self.amp_dtype,
                amp_dtype_ident=Ident(self.amp_dtype),
                sequence_parallel_size=self.sequence_parallel_size,
            )
        return {**v, **self.extra}


_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def render_template(text: str, values: dict[str, object], source: str = "<template>") -> str:
    """Substitute `{{name}}` with repr(value) (or the bare identifier for Ident); every name must match."""
    used = set(_PLACEHOLDER.findall(text))
    missing = sorted(used - set(values))
    unused = sorted(set(values) - used)
    if missing or unused:
        raise XTunerConfigError(
            f"{source}: placeholders without a value: {missing}; values without a placeholder: {unused}"
        )

    def sub(m: re.Match) -> str:
        v = values[m.group(1)]
        return str(v) if isinstance(v, Ident) else repr(v)

    return _PLACEHOLDER.sub(sub, text)


def render_config(inputs: RenderInputs, out: Path) -> Path:
    """Write the rendered config for `inputs.profile` to `out` (atomically) and return it."""
    tmpl = TEMPLATES / f"sft_{inputs.profile}.py.tmpl"
    text = render_template(tmpl.read_text(encoding="utf-8"), inputs.values(), source=str(tmpl))
    compile(text, str(out), "exec")  # a rendering bug fails here, not in a rank
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out


# ------------------------------------------------------------------------------------------------ checks


def resolve_map_fn(name: str) -> MapFn:
    key = name.removesuffix("_map_fn")
    if key not in MAP_FNS:
        raise XTunerConfigError(
            f"train.xtuner.map_fn: unknown map function {name!r}; known: {', '.join(sorted(MAP_FNS))}"
        )
    return MAP_FNS[key]


def check_template(name: str) -> str:
    if name not in PROMPT_TEMPLATES:
        raise XTunerConfigError(
            f"train.xtuner.template: unknown prompt template {name!r}; known: {', '.join(sorted(PROMPT_TEMPLATES))}"
        )
    return name


def check_base_model(path: str | Path) -> Path:
    """The base model folder has config.json, a tokenizer and weights; name what is missing."""
    p = Path(path)
    if not str(path) or not p.is_dir():
        raise XTunerConfigError(f"train.xtuner.base_model: not a folder: {str(path)!r}")
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        missing.append("a tokenizer (" + " or ".join(TOKENIZER_FILES) + ")")
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        missing.append("weights (" + " or ".join(WEIGHT_GLOBS) + ")")
    if missing:
        raise XTunerConfigError(f"train.xtuner.base_model: {p}: missing {', '.join(missing)}")
    why = xtuner_refusal(json.loads((p / "config.json").read_text(encoding="utf-8")).get("model_type"))
    if why is not None:
        raise XTunerConfigError(f"train.xtuner.base_model: {p}: {why}")
    return p


def _columns(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    if not first.strip():
        return []
    try:
        return list(json.loads(first))
    except ValueError as e:
        raise XTunerConfigError(f"{path}:1: not JSON: {e}") from None


def check_data_files(files: list[Path], map_fn: MapFn) -> str:
    """Every file exists and has the columns the map function reads; return the datasets loader name."""
    if not files:
        raise XTunerConfigError("dataset: the shard manifest lists no shards")
    kinds = {f.suffix for f in files}
    if len(kinds) != 1 or kinds - {".parquet", ".jsonl", ".json"}:
        raise XTunerConfigError(f"dataset: shards must be all .parquet or all .jsonl, got {sorted(kinds)}")
    for f in files:
        if not f.is_file():
            raise XTunerConfigError(f"dataset: shard file not found: {f}")
        cols = _columns(f)
        need = [c for c in map_fn.columns if c not in cols]
        if need:
            raise XTunerConfigError(
                f"train.xtuner.map_fn: {map_fn.name} reads column(s) {need} that {f} lacks (it has {cols})"
            )
    return "parquet" if kinds == {".parquet"} else "json"


def check_profile(profile: str, method: str, zero_stage: int, sequence_parallel_size: int) -> None:
    """Refuse what the CPU profile cannot run (see shared/notes/xtuner-on-cpu.md), before renting anything."""
    if profile != "cpu":
        return
    if method == "qlora":
        raise XTunerConfigError("train.xtuner.method: qlora needs CUDA (bitsandbytes 4-bit); this node has none")
    if sequence_parallel_size > 1:
        raise XTunerConfigError("train.xtuner.sequence_parallel_size: > 1 needs CUDA and flash_attn")
    if zero_stage > 0:
        raise XTunerConfigError("train.xtuner.zero_stage: DeepSpeed is only in the GPU env profile")


def micro_batches(global_batch: int, world: int, micro_batch: int | None, zero_stage: int = 0, sp: int = 1) -> int:
    """`micro_batch.micro_batches_per_step`, its error as an XTunerConfigError (same message, naming the field)."""
    try:
        return micro_batches_per_step(global_batch, world, micro_batch, zero_stage, sp)
    except ValueError as err:
        raise XTunerConfigError(str(err)) from None


def read_processed_stats(processed_dir: Path) -> dict:
    """Stats of the processed dataset; an empty or missing one is an error naming the folder."""
    f = Path(processed_dir) / STATS_FILE
    if not f.is_file():
        raise XTunerConfigError(f"processed dataset missing or incomplete: {processed_dir} (no {STATS_FILE})")
    stats = json.loads(f.read_text(encoding="utf-8"))
    if stats.get("rows", 0) <= 0:
        raise XTunerConfigError(f"processed dataset is empty: {processed_dir}")
    return stats
