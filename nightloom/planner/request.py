"""Planner inputs and outputs: what to plan for (PlanRequest), a partly fixed layout, and the PlanReport."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import Field

from nightloom.catalog import GPUSpec
from nightloom.parallel import ParallelPlan, Rejection, Schedule
from nightloom.planner.task import PostTraining, TaskSplit
from nightloom.records import Record
from nightloom.shape import ModelShape
from nightloom.spec.stage_list import stage_list_errors, stages_text
from nightloom.wording import percent, thousands

RECOMPUTE_MODES = ("none", "selective", "full")


class PlanError(ValueError):
    """No layout can run (divisibility), or none fits when the caller needs one that does."""


@dataclass(frozen=True)
class FixedLayout:
    """The pins of a partly fixed layout (`--layout`, `--stages`, or an explicit ParallelSpec): the fields of
    ParallelDims the user chose, None = the planner chooses. `dp` pins the data-parallel total only; `zero="none"`
    pins plain data parallel (all of dp on dp_replicate)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None  # total data parallel; split into replicate × shard by the planner unless pinned
    dp_replicate: int | None = None
    dp_shard: int | None = None
    cp: int | None = None
    sp: bool | None = None
    micro_batch: int | None = None
    virtual_stages: int | None = None
    recompute: Literal["none", "selective", "full"] | None = None
    zero: Literal["none", "fsdp", "zero2"] | None = None
    stages: tuple[int, ...] | None = None  # transformer layers per pipeline stage (uneven split)
    ep: int | None = None  # expert parallel (MoE), drawn from the data-parallel ranks
    reduce_each_micro_batch: bool | None = None  # FSDP2 reduce-scatters every micro-batch (None: where it fits)
    offload_layers: int | None = None  # activations of each rank's first n layers in host memory (None: to fit)
    schedule: Schedule | None = None  # pipeline schedule (pp > 1)

    def __post_init__(self) -> None:
        if self.zero == "none" and self.dp_shard is not None and self.dp_shard > 1:
            raise ValueError(
                f"layout: dp_shard={self.dp_shard} with zero=none would be replicas: plain data parallel is "
                f"dp_replicate={self.dp_shard * (self.dp_replicate or 1)} (or dp={self.dp_shard}, zero=none)"
            )
        if self.stages is not None and self.pp is not None and len(self.stages) % self.pp:
            raise ValueError(
                f"layout: stages {list(self.stages)} has {len(self.stages)} sizes, not a multiple of pp={self.pp}"
            )


_LAYOUT_KEYS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "dp_replicate": "dp_replicate",
    "dpr": "dp_replicate",
    "dp_shard": "dp_shard",
    "fsdp": "dp_shard",
    "cp": "cp",
    "sp": "sp",
    "mb": "micro_batch",
    "micro_batch": "micro_batch",
    "v": "virtual_stages",
    "virtual_stages": "virtual_stages",
    "recompute": "recompute",
    "zero": "zero",
    "stages": "stages",
    "ep": "ep",
    "reduce_each": "reduce_each_micro_batch",
    "reduce_each_micro_batch": "reduce_each_micro_batch",
    "offload": "offload_layers",
    "offload_layers": "offload_layers",
    "schedule": "schedule",
}


def parse_layout(text: str) -> FixedLayout:
    """Parse `tp=8,pp=4,dp=32[,cp=2,ep=8,sp=1,mb=2,v=2,recompute=full,zero=fsdp|zero2|none,stages=7:8:8:7,
    reduce_each=1,offload=2,schedule=zbv]` into a
    FixedLayout (clear errors). Stage sizes are separated by ':' (a comma separates keys)."""
    vals: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        raw = raw.strip()
        if not sep or key not in _LAYOUT_KEYS:
            raise ValueError(f"--layout: cannot read {part!r}; expected KEY=VALUE with KEY in {sorted(_LAYOUT_KEYS)}")
        name = _LAYOUT_KEYS[key]
        if name == "recompute":
            if raw not in RECOMPUTE_MODES:
                raise ValueError(f"--layout: recompute={raw!r}; expected one of {', '.join(RECOMPUTE_MODES)}")
            vals[name] = raw
        elif name == "zero":
            if raw not in ("none", "fsdp", "zero2"):
                raise ValueError(f"--layout: zero={raw!r}; expected none, fsdp or zero2")
            vals[name] = raw
        elif name == "schedule":
            if raw not in get_args(Schedule):
                raise ValueError(f"--layout: schedule={raw!r}; expected one of {', '.join(get_args(Schedule))}")
            vals[name] = raw
        elif name == "stages":
            vals[name] = parse_stages(raw, "--layout: stages")
        elif name in ("sp", "reduce_each_micro_batch"):
            if raw.lower() not in ("0", "1", "true", "false", "yes", "no"):
                raise ValueError(f"--layout: {key}={raw!r}; expected 0/1 or true/false")
            vals[name] = raw.lower() in ("1", "true", "yes")
        else:
            try:
                n = int(raw)
            except ValueError:
                raise ValueError(f"--layout: {key}={raw!r} is not an integer") from None
            if n < (0 if name == "offload_layers" else 1):
                raise ValueError(f"--layout: {key}={n} must be >= {0 if name == 'offload_layers' else 1}")
            vals[name] = n
    if not vals:
        raise ValueError(f"--layout: empty layout {text!r}; e.g. tp=8,pp=4,dp=32")
    return FixedLayout(**vals)


def parse_stages(text: str, where: str = "--stages") -> tuple[int, ...]:
    """`7,8,8,7` or `7:8:8:7` (or `[7, 8, 8, 7]`, or with runs `0:1*126:0`) into stage sizes, each >= 1 except the first and last, which may
    be 0 (an embedding-only first stage, a head-only last one; ParallelDims.check has the full rule)."""
    parts = [p.strip() for p in text.strip().strip("[]").replace(":", ",").split(",") if p.strip()]
    try:  # N*K: K stages of N layers (stages_text writes long runs so)
        sizes = tuple(int(n) for p in parts for n in [p.partition("*")[0]] * int(p.partition("*")[2] or 1))
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not a list of integers, e.g. 7,8,8,7 or 0:1*126:0") from None
    if not sizes or stage_list_errors(sizes, len(sizes)):
        raise ValueError(
            f"{where}: {text!r}: give one size per pipeline stage, >= 1 except the first and last (>= 0: embedding "
            "only, head only)"
        )
    return sizes


@dataclass(frozen=True)
class PlanRequest:
    """Everything the planner needs: model shape, cluster, training setup and what the user allows or pins.

    `gpu=None` means CPU ranks (no datasheet peak): a runnable layout is chosen, nothing is predicted."""

    shape: ModelShape
    gpu: GPUSpec | None
    nodes: int
    gpus_per_node: int
    seq_len: int
    global_batch: int
    precision: Literal["bf16", "fp32", "fp8"] = "bf16"  # fp8: the catalog's FP8 peak, bf16 states
    recompute: tuple[str, ...] = RECOMPUTE_MODES  # modes the search may use
    allow_zero: bool = True  # ZeRO-3/FSDP, ZeRO-2 (and HSDP) over the data-parallel ranks
    native_trainer: bool = True  # False: also layouts only other trainers run (what-if predictions)
    fused_attention: bool = True  # SDPA's flash-style kernel: no stored scores; False = materialised (PTD-P)
    tp_across_nodes: bool = False
    lora_rank: int | None = None  # train.lora: frozen base weights + adapters of this rank (memory)
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_quantize: str | None = None  # train.lora.quantize: the base's linears quantized (nf4, fp4, int8)
    lora_double_quant: bool = True
    task: PostTraining | None = None  # train.task dpo / grpo: what a step adds to pretraining (post_training.py)
    fixed: FixedLayout | None = None
    calibration: float | None = None  # measured/predicted MFU of past runs on this GPU type
    efficiency: float | None = None  # override the compute efficiency factor (default: calibrated constant)
    alternatives: int = 5
    world_size: int | None = None  # defaults to nodes × gpus_per_node (a re-plan after node loss passes fewer)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "seq_len", "global_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        bad = [r for r in self.recompute if r not in RECOMPUTE_MODES]
        if bad or not self.recompute:
            raise ValueError(
                f"recompute modes {list(self.recompute)}: expected a non-empty subset of {RECOMPUTE_MODES}"
            )
        if self.calibration is not None and not self.calibration > 0:
            raise ValueError(f"calibration (measured/predicted MFU) must be > 0, got {self.calibration}")
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")

    @property
    def world(self) -> int:
        return self.world_size or self.nodes * self.gpus_per_node


class PlanReport(Record):
    """The chosen layout with its predictions, the runners-up, and why every other family lost."""

    chosen: ParallelPlan
    alternatives: list[ParallelPlan] = Field(default_factory=list)
    rejected: list[Rejection] = Field(default_factory=list)
    considered: int = 0
    pruned: int = 0
    evaluated: bool = False  # True: a pinned layout was evaluated, not searched
    predicted: bool = True  # False on CPU: no peak, no memory model for host RAM
    model: str = ""
    gpu: str = "cpu"
    world_size: int = 1
    efficiency: float | None = None
    min_memory_gib: float | None = None  # the least memory per GPU any divisible layout needs
    usable_memory_gib: float | None = None
    post_training: TaskSplit | None = None  # the chosen layout's DPO / GRPO step split (post_training.py)

    @property
    def feasible(self) -> bool:
        return self.chosen.fits is not False

    def table_rows(self, rejected: int = 0) -> list[dict[str, object]]:
        """The plan table (the CLI table and the Prefect artifact): chosen + alternatives, then up to `rejected`
        rejected families with their reason. Every row has every column (a table shows the first row's keys).
        MFU and HFU read as percentages and tokens/s with thousands separators, as everywhere else; `--json`
        keeps the numbers."""
        rows = []
        for tag, p in [("chosen", self.chosen)] + [("alternative", a) for a in self.alternatives]:
            rows.append(
                {
                    "status": tag,
                    "layout": p.layout(),
                    "stages": stages_text(p.stages) if p.stages else None,
                    "mb": p.micro_batch,
                    "accum": p.grad_accum,
                    "v": p.virtual_stages,
                    "schedule": p.schedule if p.pp > 1 else None,
                    "recompute": p.recompute,
                    "mem_gib": _r(p.memory_gib_per_gpu, 1),
                    "fits": p.fits,
                    "step_s": _r(p.step_time_s, 3),
                    "tokens/s": None if p.tokens_per_s is None else thousands(p.tokens_per_s),
                    "MFU": None if p.mfu is None else percent(p.mfu),
                    "HFU": None if p.hfu is None else percent(p.hfu),
                    "reason": None,
                }
            )
        blank = dict.fromkeys(rows[0])
        for r in self.rejected[:rejected]:
            rows.append(blank | {"status": "rejected", "layout": r.layout, "reason": r.reason})
        return rows


def _r(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)
