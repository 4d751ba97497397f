"""Parallelism planner: choose a hybrid layout (TP/PP with even or uneven stages/DP replicas, FSDP, ZeRO-2 or
HSDP/CP/SP, micro-batch, recompute) that fits and is fast.

`plan(...)` is the pure entry point (model name or HF config, GPU type, cluster, batch); `plan_for_spec` adapts
a RunSpec (the pipeline's plan stage). Every candidate is a nightloom.parallel.ParallelDims and passes its
`check` (the rules the spec and the trainer apply) before it is scored. Memory: planner/memory.py; step time:
planner/steptime.py; search: planner/search.py.
"""

from __future__ import annotations

import math
from typing import Any

from nightloom.catalog import get_gpu
from nightloom.model_resolver import model_shape, shape_from_name_or_config
from nightloom.parallel import LayoutError, ParallelDims
from nightloom.perf import resolve_precision
from nightloom.planner.request import (
    RECOMPUTE_MODES,
    FixedLayout,
    PlanError,
    PlanReport,
    PlanRequest,
    parse_layout,
    parse_stages,
)
from nightloom.planner.search import search
from nightloom.planner.steptime import DEFAULT_EFFICIENCY, calibrated_efficiency
from nightloom.planner.task import PostTraining, post_training_of
from nightloom.shape import ModelShape

__all__ = [
    "DEFAULT_EFFICIENCY",
    "RECOMPUTE_MODES",
    "FixedLayout",
    "PlanError",
    "PlanReport",
    "PlanRequest",
    "PostTraining",
    "calibrated_efficiency",
    "parse_layout",
    "parse_stages",
    "plan",
    "plan_for_spec",
    "search",
]


def plan(
    model: str | ModelShape,
    gpu: str,
    nodes: int,
    gpus_per_node: int,
    seq_len: int,
    global_batch: int,
    layout: str | FixedLayout | None = None,
    recompute: str | tuple[str, ...] | None = None,
    *,
    stages: str | tuple[int, ...] | None = None,
    **options: Any,
) -> PlanReport:
    """Plan from plain values (the CLI path). `model`: catalog name, HF config.json path, or a ModelShape;
    `gpu`: catalog GPU type or "cpu"; `layout`: pins such as "tp=8,pp=4,dp=32" (evaluated, not searched);
    `recompute`: one mode (restricts the search) or a tuple of allowed modes; `stages`: forced pipeline stage
    sizes ("7,8,...,8,7"); `options`: PlanRequest's other fields as they are (precision, allow_zero,
    calibration, world_size, native_trainer, fused_attention, lora_*, task)."""
    shape = model if isinstance(model, ModelShape) else shape_from_name_or_config(model)
    if options.get("precision", "bf16") not in ("bf16", "fp32", "fp8"):
        raise ValueError(f"precision must be bf16, fp32 or fp8, got {options['precision']!r}")
    fixed = parse_layout(layout) if isinstance(layout, str) else layout
    modes = RECOMPUTE_MODES if recompute is None else ((recompute,) if isinstance(recompute, str) else recompute)
    if fixed is not None and fixed.recompute is None and recompute is not None and len(modes) == 1:
        fixed = FixedLayout(**{**vars(fixed), "recompute": modes[0]})
    if stages is not None:
        sizes = parse_stages(stages) if isinstance(stages, str) else tuple(stages)
        pins = vars(fixed or FixedLayout())
        pp = pins["pp"] or len(sizes) // (pins["virtual_stages"] or 1)
        fixed = FixedLayout(**{**pins, "stages": sizes, "pp": pp})
    if "lora_targets" in options:
        options["lora_targets"] = tuple(options["lora_targets"])
    gspec = None if gpu == "cpu" else get_gpu(gpu)
    return search(
        PlanRequest(
            shape, gspec, nodes, gpus_per_node, seq_len, global_batch, recompute=tuple(modes), fixed=fixed, **options
        )
    )


def plan_for_spec(
    spec, world_size: int | None = None, calibration: float | None = None, *, require_fit: bool = True
) -> PlanReport:
    """Plan for a RunSpec. `world_size` overrides the spec's (re-plan after node loss; the global batch stays,
    grad_accum makes up for fewer DP ranks). An explicit `parallel:` section is evaluated, not searched
    (dp_shard=-1 = the rest of the world size); with `parallel: auto` and require_fit, nothing fitting raises
    PlanError (the CLI passes require_fit=False to print the report instead).
    `calibration` = measured/predicted MFU of past ledger runs (bounded adjustment of the efficiency factor)."""
    from nightloom.spec import ParallelSpec

    shape = model_shape(spec.model)
    cl, tr = spec.cluster, spec.train
    gpu = cl.gpu_type
    precision = resolve_precision(tr.precision, gpu)
    ws = world_size or spec.world_size
    nodes = max(1, math.ceil(ws / cl.gpus_per_node))
    fixed = None
    if isinstance(spec.parallel, ParallelSpec):
        fixed = spec_layout(spec.parallel, ws)
    pins = fixed or trainer_pins(shape, tr)
    task = post_training_of(tr)  # dpo and grpo: their steps' own memory and time
    report = plan(
        shape,
        gpu,
        nodes,
        cl.gpus_per_node,
        tr.seq_len,
        task.sequences if task is not None and task.task == "grpo" else tr.global_batch,
        layout=pins,
        precision=precision,
        calibration=calibration,
        world_size=ws,
        task=task,
        **_lora_of(tr),
    )
    if fixed is not None:
        p = spec.parallel
        if p.pp > 1 and p.schedule != report.chosen.schedule:
            report.chosen.schedule = p.schedule
            # the spec's schedule is part of the layout: the same rules apply to it
            why = report.chosen.dims().check(shape, tr.seq_len, tr.global_batch)
            if why:
                raise LayoutError("parallel: " + "; ".join(why))
        return report
    if require_fit and not report.feasible:
        raise PlanError(
            f"no layout of {shape.name} fits {ws} × {gpu}: the smallest needs "
            f"{report.min_memory_gib:.1f} GiB per GPU, {report.usable_memory_gib:.1f} GiB usable"
        )
    return report


def trainer_pins(shape: ModelShape, train) -> FixedLayout | None:
    """What `parallel: auto` may not choose because the trainer refuses it: packed rows carry a per-row document
    mask, which the pipeline schedule and ring attention do not take (pp = cp = 1); a mixture of experts trains
    with EP and FSDP2 only (tp = pp = cp = dp_replicate = 1, train/moe.py); train.compile cannot compile a
    recomputed block under TP (train/parallelize.check_compile), so a compiled run is planned without recompute;
    a quantized LoRA base (train.lora.quantize) runs in one process or under FSDP2 (tp = pp = 1), DoRA (its row
    norm) and trained token rows with tp = 1, modules trained in full with tp = pp = 1; dpo and grpo run
    without pp, cp and ep, grpo's rollouts without sp."""
    pins: dict = {}
    if shape.moe:
        pins |= dict(tp=1, pp=1, cp=1, dp_replicate=1)
    if getattr(train, "pack", False):
        pins |= dict(pp=1, cp=1)
    if getattr(train, "compile", False):
        pins |= dict(recompute="none")
    if getattr(getattr(train, "lora", None), "quantize", None):  # a quantized base: one process or FSDP2
        pins |= dict(tp=1, pp=1)
    lora = getattr(train, "lora", None)
    if getattr(lora, "use_dora", False) or getattr(lora, "trainable_token_indices", None):  # whole rows (train/lora.py)
        pins |= dict(tp=1)
    if getattr(lora, "modules_to_save", None):  # modules trained in full: one process or FSDP2 (spec/lora.py)
        pins |= dict(tp=1, pp=1)
    if getattr(train, "task", None) == "dpo":  # preference tuning: one process, FSDP2, TP (spec/preference.py)
        pins |= dict(pp=1, cp=1, ep=1)
    if getattr(train, "task", None) == "grpo":  # rollouts in the training ranks: FSDP2, TP without sp (spec/grpo.py)
        pins |= dict(pp=1, cp=1, ep=1, sp=False)
        if getattr(getattr(train, "grpo", None), "engine", "native") == "vllm":  # colocated vLLM: tp 1
            pins |= dict(tp=1)
    return FixedLayout(**pins) if pins else None


def _lora_of(train) -> dict:
    """train.lora as the planner's lora_rank / lora_targets (none without adapters)."""
    lora = getattr(train, "lora", None)
    if lora is None:
        return {}
    targets = (lora.targets,) if isinstance(lora.targets, str) else tuple(lora.targets)
    quant = getattr(lora, "quantize", None)
    return {
        "lora_rank": lora.rank,
        "lora_targets": targets,
        "lora_quantize": quant,
        "lora_double_quant": getattr(lora, "double_quant", True),
    }


def spec_layout(p, world_size: int) -> FixedLayout:
    """The pins of an explicit `parallel:` section (a ParallelSpec) on `world_size` ranks: every knob pinned,
    dp_shard=-1 filled by ParallelDims (LayoutError when the world size does not divide)."""
    dims = ParallelDims.resolve(
        world_size, tp=p.tp, pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, sp=p.sp
    )
    return FixedLayout(
        tp=p.tp,
        pp=p.pp,
        dp_replicate=p.dp_replicate,
        dp_shard=dims.dp_shard,
        cp=p.cp,
        sp=p.sp,
        micro_batch=p.micro_batch,
        virtual_stages=p.virtual_stages,
        recompute=p.recompute,
        zero=p.zero if dims.dp_shard > 1 else "none",
        stages=tuple(p.stages) if p.stages else None,
        reduce_each_micro_batch=p.reduce_each_micro_batch,
        offload_layers=p.offload_layers,
        schedule=p.schedule if p.pp > 1 else None,
        ep=getattr(p, "ep", None),  # parallel.ep once the spec has it
    )
