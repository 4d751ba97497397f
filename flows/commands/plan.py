"""`nightloom plan`: choose (or evaluate) a parallel layout for a spec or for a model on a cluster, and say why.

Exit codes: 0 a layout fits (or CPU: a runnable layout was chosen), 1 no layout fits (the message names the
smallest memory per GPU any layout needs) or the spec does not validate, 2 usage error (bad arguments, unknown
model/GPU, bad config.json).
"""

from __future__ import annotations

import argparse
import json
import sys

from flows.commands.common import UsageError, failed, load_spec_file, spec_invalid, usage
from flows.commands.spec_flags import SpecFlag, add_spec_flags
from nightloom.planner.request import RECOMPUTE_MODES, PlanError, PlanReport
from nightloom.spec import ClusterSpec, TrainSpec

JSON_KEYS = (
    "tp",
    "pp",
    "dp_replicate",
    "dp_shard",
    "cp",
    "ep",
    "sp",
    "micro_batch",
    "grad_accum",
    "virtual_stages",
    "stages",
    "schedule",
    "recompute",
    "zero",
    "reduce_each_micro_batch",
    "offload_layers",
    "memory_gib_per_gpu",
    "fits",
    "step_time_s",
    "tflops_per_gpu_model",
    "tflops_per_gpu_hardware",
    "mfu",
    "hfu",
    "tokens_per_s",
)


#: the cluster and batch of a --model plan, declared by the spec fields they stand for (required without SPEC)
_CLUSTER_FLAGS = (
    SpecFlag("--gpu", "cluster", "gpu_type", ClusterSpec, "catalog GPU type (a100-80gb, h100-80gb, ...) or cpu"),
    SpecFlag("--nodes", "cluster", "nodes", ClusterSpec, "nodes"),
    SpecFlag("--gpus-per-node", "cluster", "gpus_per_node", ClusterSpec, "GPUs per node"),
    SpecFlag("--seq-len", "train", "seq_len", TrainSpec, "tokens per sequence"),
    SpecFlag("--global-batch", "train", "global_batch", TrainSpec, "sequences per optimizer step"),
)


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="choose a parallel layout (TP/PP/DP/SP, micro-batch, recompute) and predict memory and MFU",
        description="nightloom plan SPEC, or nightloom plan --model NAME_OR_CONFIG --gpu TYPE --nodes N "
        "--gpus-per-node G --seq-len S --global-batch B [--layout tp=8,pp=4,dp=32]",
    )
    p.add_argument("spec", nargs="?", help="run spec YAML (alternatively give --model and the cluster flags)")
    p.add_argument(
        "--model",
        help="catalog model name (llama3-8b, llama3.2-1b, qwen3-8b, ...) or a Hugging Face config.json or its folder "
        "(llama, mistral, qwen2, qwen3, gemma3, tied or untied; gpt2 for planning only)",
    )
    add_spec_flags(p, _CLUSTER_FLAGS)
    p.add_argument(
        "--layout",
        help="evaluate this layout instead of searching, e.g. tp=8,pp=4,dp=32 "
        "(also cp=, ep=, sp=, mb=, v=, recompute=, zero=none|fsdp|zero2, dp_replicate=, dp_shard=, stages=7:8:8:7)",
    )
    p.add_argument(
        "--stages",
        help="force uneven pipeline stages: transformer layers per stage, e.g. 7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7 "
        "(sets pp to their count unless --layout pins it)",
    )
    p.add_argument(
        "--other-trainer",
        action="store_true",
        help="what-if: also layouts only other trainers run (e.g. context parallel together with pipeline parallel, as Megatron); "
        "nightloom's own trainer rules are not applied",
    )
    p.add_argument(
        "--attention",
        choices=("fused", "materialized"),
        default="fused",
        help="fused (default): a flash-style kernel stores no attention scores, as the trainer's SDPA on a GPU; "
        "materialized: the s² scores are stored (PTD-P-era stacks; a what-if for --model plans)",
    )
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, help="restrict activation recompute to this mode")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--no-zero", action="store_true", help="do not shard weights/optimizer states (no FSDP/ZeRO)")
    p.add_argument("--calibration", type=float, help="measured/predicted MFU of past runs (bounded adjustment)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def _report(args) -> PlanReport:
    from nightloom.planner import plan, plan_for_spec

    if args.spec:
        if args.layout or args.stages or args.other_trainer or args.attention != "fused":
            raise ValueError(
                "--layout, --stages, --other-trainer and --attention apply to --model plans; a spec pins its own"
            )
        spec = load_spec_file(args.spec)
        return plan_for_spec(spec, calibration=args.calibration, require_fit=False)
    missing = ["--model"] * (args.model is None) + [f.flag for f in _CLUSTER_FLAGS if getattr(args, f.dest) is None]
    if missing:
        raise ValueError(
            f"give a SPEC, or all of --model --gpu --nodes --gpus-per-node --seq-len --global-batch "
            f"(missing: {' '.join(missing)})"
        )
    return plan(
        args.model,
        args.gpu,
        args.nodes,
        args.gpus_per_node,
        args.seq_len,
        args.global_batch,
        layout=args.layout,
        recompute=args.recompute,
        precision=args.precision,
        allow_zero=not args.no_zero,
        calibration=args.calibration,
        stages=args.stages,
        native_trainer=not args.other_trainer,
        fused_attention=args.attention == "fused",
    )


def to_json(r: PlanReport) -> dict:
    """The `--json` object: chosen (or evaluated) layout, alternatives, rejected families, counts."""
    key = "evaluated" if r.evaluated else "chosen"

    def flat(p) -> dict:
        return {k: getattr(p, k) for k in JSON_KEYS} | {"layout": p.layout()}

    return {
        key: flat(r.chosen) | {"explanation": r.chosen.explanation},
        "alternatives": [flat(a) for a in r.alternatives],
        "rejected": [{"layout": x.layout, "reason": x.reason} for x in r.rejected],
        "considered": r.considered,
        "pruned": r.pruned,
        "fits": r.chosen.fits,
        "predicted": r.predicted,
        "min_memory_gib": r.min_memory_gib,
        "usable_memory_gib": r.usable_memory_gib,
        "model": r.model,
        "gpu": r.gpu,
        "world_size": r.world_size,
        "efficiency": r.efficiency,
        "post_training": r.post_training.model_dump() if r.post_training else None,  # a dpo or grpo step's split
    }


def _print_pretty(r: PlanReport) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 150)
    title = f"{'evaluated' if r.evaluated else 'plan'}: {r.model} on {r.world_size} × {r.gpu}"
    t = Table(title=title)
    rows = r.table_rows()
    cols = [c for c in rows[0] if c not in ("stages", "reason") or any(row[c] is not None for row in rows)]
    for col in cols:
        t.add_column(col, justify="right" if col not in ("status", "layout", "stages", "recompute") else "left")
    for row in rows:
        t.add_row(*("—" if row[c] is None else str(row[c]) for c in cols))
    con.print(t)
    for line in r.chosen.explanation:
        con.print(f"  • {line}", highlight=False)
    if r.rejected:
        con.print(f"rejected ({len(r.rejected)} families; {r.considered} layouts considered, {r.pruned} pruned):")
        for x in r.rejected[:12]:
            con.print(f"  - {x.layout}: {x.reason}", highlight=False)
        if len(r.rejected) > 12:
            con.print(f"  … {len(r.rejected) - 12} more (--json lists all)")


def run(args) -> int:
    from nightloom.parallel import LayoutError
    from nightloom.spec import SpecError

    try:
        report = _report(args)
    except SpecError as e:
        return spec_invalid(e)
    except (PlanError, LayoutError) as e:  # no layout can run at all (divisibility): the input is the problem
        return failed("plan", str(e))
    except (ValueError, KeyError) as e:
        return usage("plan", str(e.args[0] if isinstance(e, KeyError) else e))
    if args.json:
        print(json.dumps(to_json(report), indent=2))
    else:
        _print_pretty(report)
    if report.chosen.fits is False:
        print(
            f"nightloom plan: no layout fits: the smallest needs {report.min_memory_gib:.1f} GiB per GPU "
            f"({report.usable_memory_gib:.1f} GiB usable of {report.gpu})",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `plan` alone (before flows/cli.py registers it): python -m flows.commands.plan ..."""
    parser = argparse.ArgumentParser(prog="nightloom")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except UsageError as e:
        return usage("plan", str(e))


if __name__ == "__main__":
    raise SystemExit(main())
