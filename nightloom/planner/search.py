"""Layout search: enumerate tp × pp (× stage split) × (dp_replicate × dp_shard, zero) × cp × sp × micro-batch × v ×
recompute, prune, rank.

Every candidate is a ParallelDims and is pruned by its `check` (the rules the spec and the trainer apply too),
then by memory (nightloom.planner.memory); the survivors are ranked by predicted tokens/s
(nightloom.planner.steptime). A family (tp, pp, dp split, cp) is rejected once, with the reason of its most
permissive member, when the rules fail it; every family that loses gets one reason. Beyond the checks, the
search space itself: tp stays within a node unless allowed; pipeline splits are even, or equal inner stages with
lighter end stages (Llama 3's 126 layers on 16 stages: 7 + 14·8 + 7); any other split is forced by the user, and a
forced list of pp sizes (layers per rank) may be interleaved into v chunks per rank (`interleave_stages`).
Context parallel is searched when the sequence is long (>= LONG_SEQ) and the native trainer's rules allow it.
Expert parallel (MoE models) is searched within each family: every ep dividing the experts and the data-parallel
ranks it is drawn from (ParallelDims.check); the family's best ep wins, and the explanation says what it saved.
"""

from __future__ import annotations

from dataclasses import dataclass

from nightloom.parallel import ParallelDims, ParallelPlan, Rejection, layout_name
from nightloom.perf import active_params, count_params, expert_params, flops_per_token, mfu
from nightloom.planner.memory import memory_breakdown, rank_layers, usable_gib
from nightloom.planner.offload import fit_memory
from nightloom.planner.post_training import TaskMemory, task_memory, task_step
from nightloom.planner.request import FixedLayout, PlanError, PlanReport, PlanRequest
from nightloom.planner.stage_splits import interleave_stages, stage_splits
from nightloom.planner.steptime import (
    DEFAULT_EFFICIENCY,
    StepEstimate,
    bubble_fraction,
    calibrated_efficiency,
    step_time,
)
from nightloom.planner.task import TaskSplit, explain_lines, splits_groups, task_dims
from nightloom.spec.stage_list import stages_text
from nightloom.wording import plural

MAX_VIRTUAL_STAGES = 8
#: sequences at least this long make the search consider context parallel
LONG_SEQ = 32768


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class _Scored:
    c: ParallelDims
    mem: object  # MemoryBreakdown
    step: StepEstimate | None
    tokens_per_s: float | None
    task_mem: TaskMemory | None = None  # train.task dpo / grpo: their own memory terms (post_training.py)
    split: TaskSplit | None = None


def _families(req: PlanRequest, fixed: FixedLayout, rejected: dict[str, str]):
    """(tp, pp, stage split, dp_replicate, dp_shard, zero, cp) that pass the layout rules in their most
    permissive form (micro-batch 1, all the batch as accumulation steps).

    A tp (or tp·pp) that fails is rejected once for all its data-parallel splits (`TP16·*`)."""
    shape, world, gpn, seq, gb = req.shape, req.world, req.gpus_per_node, req.seq_len, req.global_batch
    native = req.native_trainer
    out = []
    for tp in _divisors(world):
        if fixed.tp is not None and tp != fixed.tp:
            continue
        why = ParallelDims(tp=tp).check(shape, seq, None, native_trainer=native)
        if why:
            rejected[f"TP{tp}·*"] = why[0]
            continue
        if tp > gpn and not req.tp_across_nodes:
            rejected[f"TP{tp}·*"] = (
                f"tp={tp} would span nodes ({gpn} GPUs per node); tensor parallel stays on the intra-node links"
            )
            continue
        if fixed.cp is not None:
            cps = [fixed.cp]
        elif seq >= LONG_SEQ:
            cps = [c for c in _divisors(world // tp) if c <= 32]
        else:
            cps = [1]
        for cp in cps:
            if (world // tp) % cp:
                continue
            for pp in _divisors(world // (tp * cp)):
                if fixed.pp is not None and pp != fixed.pp:
                    continue
                dp = world // (tp * pp * cp)
                if fixed.dp is not None and dp != fixed.dp:
                    continue
                name = f"TP{tp}·PP{pp}·" + (f"CP{cp}·" if cp > 1 else "") + "*"
                splits = _splits(req, fixed, pp)
                if not splits:
                    rejected[name] = (
                        f"pp={pp} does not divide layers ({shape.layers}) and no split with equal inner stages and "
                        "lighter end stages exists (force one with stages=...)"
                    )
                    continue
                accum = gb // dp if gb % dp == 0 else 1
                v0, split0 = splits[0]
                sched = "interleaved_1f1b" if v0 > 1 else "1f1b"
                probe = ParallelDims(tp, pp, dp, 1, cp, False, 1, accum, v0, sched, "none", "none", split0)
                why = probe.check(shape, seq, gb, native_trainer=native)
                if why:
                    rejected[name] = why[0]
                    continue
                # plain DP: all of dp on dp_replicate; FSDP/ZeRO-2 over d ranks, HSDP with dp/d replicas
                dps = [(dp, 1, "none")]
                if req.allow_zero:
                    for d in _divisors(dp)[1:]:
                        dps.append((dp // d, d, "fsdp"))
                        if pp == 1:  # under PP the trainer keeps stages gathered anyway: ZeRO-2 is FSDP there
                            dps.append((dp // d, d, "zero2"))
                for dpr, dsh, zero in dps:
                    if fixed.zero is not None and zero != fixed.zero and dp > 1:
                        continue
                    if fixed.dp_shard is not None and dsh != fixed.dp_shard:
                        continue
                    if fixed.dp_replicate is not None and dpr != fixed.dp_replicate:
                        continue
                    out.append((tp, pp, dpr, dsh, zero, cp))
    return out


def _splits(req: PlanRequest, fixed: FixedLayout, pp: int) -> list[tuple[int, tuple[int, ...] | None]]:
    """(virtual stages, chunk split) pairs of pipeline degree `pp`: v ≤ MAX_VIRTUAL_STAGES, or as pinned."""
    layers, pinned = req.shape.layers, fixed.pp == pp
    if fixed.stages is not None and len(fixed.stages) == pp and fixed.virtual_stages != 1 and pp > 1:
        # layers per pipeline rank (as Llama 3 publishes 7 + 14·8 + 7): the search may interleave each rank's
        # layers into v chunks (Grattafiori et al. 2024 §3.3.2: interleaved 1F1B, ends one layer lighter)
        vs = [fixed.virtual_stages] if fixed.virtual_stages else range(1, MAX_VIRTUAL_STAGES + 1)
        out = [(v, interleave_stages(fixed.stages, v)) for v in vs]
        return [(v, split) for v, split in out if split is not None]
    if fixed.stages is not None:
        v = fixed.virtual_stages or max(1, len(fixed.stages) // pp)
        return [(v, fixed.stages)]
    if pp == 1:
        return [(1, None)]
    vs = [fixed.virtual_stages] if fixed.virtual_stages is not None else range(1, MAX_VIRTUAL_STAGES + 1)
    return [(v, split) for v in vs for split in stage_splits(layers, pp * v, pinned and v == 1)]


def _knobs(req: PlanRequest, fixed: FixedLayout, tp: int, pp: int, dp: int):
    """(sp, micro_batch, virtual_stages, stage split, recompute, grad_accum) choices of one family."""
    per_rank = req.global_batch // dp
    sps = [fixed.sp] if fixed.sp is not None else ([False, True] if tp > 1 else [False])
    rcs = [fixed.recompute] if fixed.recompute is not None else list(req.recompute)
    mbs = [fixed.micro_batch] if fixed.micro_batch is not None else _divisors(per_rank)
    splits = _splits(req, fixed, pp)
    for sp in sps:
        if sp and tp == 1:
            continue
        for mb in mbs:
            if per_rank % mb:
                continue
            m = per_rank // mb
            for v, split in splits:
                if v > 1 and (pp == 1 or m % pp):  # interleaving needs m % pp == 0 (Megatron)
                    continue
                for rc in rcs:
                    yield sp, mb, v, split, rc, m


def _eps(req: PlanRequest, fixed: FixedLayout, dpr: int, dps: int, cp: int) -> list[int]:
    """Expert-parallel degrees to try: 1 for a dense model; the pinned one; else the divisors of the experts
    that divide the data-parallel ranks EP is drawn from (ParallelDims.ep_pool)."""
    if fixed.ep is not None:
        return [fixed.ep]
    if not req.shape.moe:
        return [1]
    pool = dps * cp if dps > 1 else dpr * cp
    return [e for e in _divisors(req.shape.num_experts) if pool % e == 0]


def _plan_from(req: PlanRequest, s: _Scored, eff: float | None) -> ParallelPlan:
    c = s.c
    p = ParallelPlan.of(c)
    if req.gpu is None or s.step is None:
        return p
    world, seq = req.world, req.seq_len
    peak = req.gpu.peak(req.precision)
    f_model = flops_per_token(req.shape, seq)
    f_hw = flops_per_token(req.shape, seq, c.recompute, hardware=True)
    tps = s.tokens_per_s
    p.memory = s.mem
    p.memory_gib_per_gpu = s.mem.total_gib
    p.fits = s.mem.total_gib <= usable_gib(req.gpu.memory_gib)
    p.step_time_s = s.step.step_s
    p.tokens_per_s = tps
    p.mfu = mfu(tps, f_model, world, peak)
    p.hfu = mfu(tps, f_hw, world, peak)
    p.tflops_per_gpu_model = tps * f_model / world / 1e12
    p.tflops_per_gpu_hardware = tps * f_hw / world / 1e12
    return p


def _fp8_mfu_line(req: PlanRequest, s: _Scored) -> list[str]:
    """fp8: the predicted MFU against both peaks, each labelled (FP8 MFU is half the bf16-peak figure on H100)."""
    if req.precision != "fp8" or s.step is None:
        return []
    tps, f = s.tokens_per_s, flops_per_token(req.shape, req.seq_len)
    fp8, bf16 = (mfu(tps, f, req.world, req.gpu.peak(x)) for x in ("fp8", "bf16"))
    return [
        f"MFU {fp8:.1%} of the FP8 peak ({req.gpu.peak('fp8') / 1e12:.0f} TFLOP/s) = {bf16:.1%} of the bf16 peak "
        f"({req.gpu.peak('bf16') / 1e12:.0f} TFLOP/s): the block matmuls run float8, the head and attention bf16"
    ]


def _explain(req: PlanRequest, s: _Scored, eff: float, runner_up: _Scored | None) -> list[str]:
    c, m, st, gpu = s.c, s.mem, s.step, req.gpu
    n = count_params(req.shape)
    moe = f", {active_params(req.shape) / 1e9:.2f}B active" if req.shape.moe else ""
    lines = [
        (
            f"{req.shape.name} ({n / 1e9:.2f}B params{moe}) on {req.world} × {gpu.name} "
            f"({plural(req.nodes, 'node')} × {req.gpus_per_node}); global batch {req.global_batch} × seq {req.seq_len}, "
            f"{req.precision}, AdamW"
        ),
        (
            f"memory/GPU (busiest stage): weights {m.weights_gib:.1f} + grads {m.grads_gib:.1f} + optimizer "
            f"{m.optimizer_gib:.1f} + activations {m.activations_gib:.1f} + overhead {m.overhead_gib:.1f} = "
            f"{m.total_gib:.1f} GiB of {usable_gib(gpu.memory_gib):.1f} usable ({gpu.memory_gib:g} GiB − "
            f"headroom); optimizer states {'sharded over dp_shard=' + str(c.dp_shard) if c.shard > 1 else 'replicated'}"
        ),
        (
            f"step {st.step_s:.3f} s: matmul {st.matmul_s:.3f} s at efficiency {eff:.2f} of "
            f"{gpu.peak(req.precision) / 1e12:.0f} TFLOP/s, memory-bound {st.hbm_s:.3f}, TP comm {st.tp_comm_s:.3f}, "
            f"PP p2p {st.pp_comm_s:.3f}, bubble {st.bubble_s:.3f} "
            + (
                "(zero-bubble V: the attention core's share of the weight passes left unfilled)"
                if c.schedule == "zbv"
                else f"((p−1)/(v·m) = {bubble_fraction(c.pp, c.virtual_stages, c.grad_accum):.3f})"
            )
            + f", DP exposed {st.dp_exposed_s:.3f}, "
            f"optimizer {st.optimizer_s:.3f}"
            + (f", CP all-gather exposed {st.cp_comm_s:.3f}" if c.cp > 1 else "")
            + (f", EP all-to-all {st.ep_comm_s:.3f}" if c.ep > 1 else "")
            + (f", offload copies exposed {st.offload_s:.3f}" if c.offload_layers else "")
        ),
    ]
    if c.offload_layers:
        lines[1] += (
            f"; the activations of each pipeline rank's first "
            f"{'layer' if c.offload_layers == 1 else f'{c.offload_layers} layers'} wait in pinned host memory "
            f"({m.host_gib:.1f} GiB per GPU)"
        )
    if c.zero == "zero2":
        lines[1] += " (ZeRO-2: parameters kept gathered from forward to backward)"
    if req.fused_attention:
        lines[1] += "; attention: fused kernel (no stored scores)"
    else:
        lines[1] += "; attention: materialised scores (5·a·s/h per token and layer stored)"
    if c.pp > 1:
        lines.insert(1, _pipeline_line(req, c, m.total_gib, st))
    if c.cp > 1:
        lines.insert(
            1,
            f"context parallel cp={c.cp}: each rank holds seq/cp = {req.seq_len // c.cp} tokens of activations; "
            f"K,V all-gathered over the cp group every layer ("
            + (
                "torch's context_parallel: hidden behind the local diagonal block, dK,dV passed on the ring"
                if req.native_trainer
                else "Llama 3's trainer: exposed, dK,dV reduce-scattered"
            )
            + f"), {st.cp_comm_s:.3f} s per step not hidden behind the attention compute",
        )
    if req.shape.moe:
        lines.insert(1, _moe_line(req, c, st))
    lines[1:1] = _fp8_mfu_line(req, s)
    lines += explain_lines(s.split)  # a dpo or grpo step: its parts
    if not req.native_trainer:
        lines.append("layout rules of nightloom's trainer not applied (a prediction for another trainer)")
    if req.calibration is not None:
        lines.append(
            f"efficiency calibrated from the ledger: {DEFAULT_EFFICIENCY:.2f} × measured/predicted "
            f"{req.calibration:.2f} (bounded) = {eff:.2f}"
        )
    if runner_up is not None and runner_up.tokens_per_s:
        rc = runner_up.c
        lines.append(
            f"next best {rc.layout()} (mb={rc.micro_batch}, v={rc.virtual_stages}, recompute={rc.recompute}) "
            f"is {_lost_by(s, runner_up)}"
        )
    return lines


def _pipeline_line(req: PlanRequest, c: ParallelDims, total_gib: float, st: StepEstimate) -> str:
    """The plan's pipeline line: chunks and layers per rank, where the embedding and head sit, the busiest rank."""
    sizes = c.stage_sizes(req.shape.layers)
    ranks = rank_layers(req.shape, c)
    split = "even" if c.stages is None else "uneven"
    where = (
        "V-shaped zero-bubble: rank r holds chunks r and 2·pp−1−r, the embedding and head on the first"
        if c.schedule == "zbv"
        else "embedding on the first, output head on the last"
    )
    return (
        f"pipeline: {len(sizes)} chunks ({split}, v={c.virtual_stages}) of {stages_text(sizes)} transformer layers, "
        f"{stages_text(ranks)} per pp rank ({where}); memory is the busiest rank's ({total_gib:.1f} GiB), step "
        f"time the slowest rank's (slot {st.slot_max_s * 1e3:.1f} ms per micro-batch, mean {st.slot_avg_s * 1e3:.1f} ms)"
    )


def _moe_line(req: PlanRequest, c: ParallelDims, st: StepEstimate) -> str:
    """What expert parallel does in this plan: experts per rank, what each GPU stores of them, the all-to-all."""
    s = req.shape
    held = _expert_storage(expert_params(s) / (c.tp * c.pp * c.ep) / 1e9, c)
    if c.ep == 1:
        return (
            f"mixture of experts ({s.num_experts} experts, top-{s.experts_per_token}): no expert parallel, every rank "
            f"computes all experts of its stage ({held}); no all-to-all"
        )
    return (
        f"expert parallel ep={c.ep} (drawn from the data-parallel ranks): each rank computes {s.num_experts // c.ep} "
        f"of {s.num_experts} experts ({held}); token dispatch/combine all-to-all {st.ep_comm_s:.3f} s per step, not "
        "overlapped"
    )


def _expert_storage(slice_b: float, c: ParallelDims) -> str:
    """What one GPU stores of the experts it computes (`slice_b` billion params): all of them, or its shard."""
    k = c.expert_shard
    if k == 1:
        return f"{slice_b:.2f}B expert params, whole on every GPU"
    if c.zero == "fsdp":
        return (
            f"{slice_b:.2f}B expert params, sharded with their gradients and optimizer states over the {k} ranks "
            f"that compute the same experts: {slice_b / k:.2f}B stored per GPU, a layer's gathered as it runs"
        )
    return (
        f"{slice_b:.2f}B expert params whole on every GPU, their gradients and optimizer states sharded over the "
        f"{k} ranks that compute the same experts ({slice_b / k:.2f}B each)"
    )


def _time(req: PlanRequest, sc: _Scored, eff: float) -> None:
    """Give a scored candidate its predicted step (steptime.py) and tokens/s."""
    sc.step = step_time(
        req.shape,
        task_dims(req.task, sc.c),  # a DPO micro-batch is 2 rows a pair
        req.seq_len,
        req.gpu,
        req.gpus_per_node,
        eff,
        req.precision,
        req.fused_attention,
        req.native_trainer,
    )
    sc.step, sc.split = task_step(req, sc.c, sc.step, eff, sc.task_mem)
    rows = req.task.rows if req.task else 1
    sc.tokens_per_s = rows * req.global_batch * req.seq_len / sc.step.step_s


def _memory_of(req: PlanRequest):
    return lambda c: _memory(req, c)


def _memory(req: PlanRequest, c: ParallelDims) -> tuple[object, TaskMemory | None]:
    """A candidate's memory (memory.py) with a dpo or grpo step's own terms (post_training.py)."""
    mem = memory_breakdown(
        req.shape,
        task_dims(req.task, c),  # a DPO micro-batch is 2 rows a pair
        req.seq_len,
        req.precision,
        req.fused_attention,
        req.lora_rank,
        req.lora_targets,
        native_trainer=req.native_trainer,
        lora_quantize=req.lora_quantize,
        lora_double_quant=req.lora_double_quant,
    )
    return task_memory(req, c, mem)


def _nothing_fits(
    req: PlanRequest,
    overall_min: _Scored,
    smallest_by_family: dict[str, _Scored],
    rejected: list[Rejection],
    counts: tuple[int, int, bool],
    eff: float,
    usable: float,
) -> PlanReport:
    """Nothing fits: report the layout that needs the least memory, marked fits=False."""
    s = overall_min
    _time(req, s, eff)
    for fam, sm in smallest_by_family.items():
        rejected.append(Rejection(layout=fam, reason=_nofit(sm, usable)))
    chosen = _plan_from(req, s, eff)
    chosen.explanation = [
        (
            f"no layout fits: the smallest needs {s.mem.total_gib:.1f} GiB per GPU "
            f"({_knob_str(s.c)}), {s.mem.total_gib - usable:.1f} GiB over the "
            f"{usable:.1f} GiB usable"
        )
    ] + _explain(req, s, eff, None)
    chosen.rejected = rejected
    return _report(req, chosen, [], rejected, counts, eff, overall_min, usable, s.split)


def search(req: PlanRequest) -> PlanReport:
    """Search (or, with a fully pinned degree set, evaluate) layouts for `req`; see the module docstring."""
    fixed = req.fixed or FixedLayout()
    evaluated = req.fixed is not None
    fam_rejected: dict[str, str] = {}
    families = _families(req, fixed, fam_rejected)
    eff = calibrated_efficiency(req.calibration, req.efficiency or DEFAULT_EFFICIENCY)
    usable = usable_gib(req.gpu.memory_gib) if req.gpu else None
    considered = pruned = 0
    pruned += len(fam_rejected)
    considered += len(fam_rejected)
    best_by_family: dict[str, _Scored] = {}
    smallest_by_family: dict[str, _Scored] = {}
    fitting: list[_Scored] = []
    overall_min: _Scored | None = None
    for tp, pp, dpr, dps, zero, cp in families:
        fam = layout_name(tp, pp, dpr, dps, cp, False, zero)
        knobs = [
            (k, ep, sched)
            for k in _knobs(req, fixed, tp, pp, dpr * dps)
            for ep in _eps(req, fixed, dpr, dps, cp)
            for sched in _schedules(fixed, pp, k[2])
        ]
        for (sp, mb, v, split, rc, m), ep, sched in knobs:
            considered += 1
            c = ParallelDims(tp, pp, dpr, dps, cp, sp, mb, m, v, sched, rc, zero, split, ep)
            why = c.check(req.shape, req.seq_len, req.global_batch, native_trainer=req.native_trainer)
            if why or splits_groups(req.task, c):  # grpo: whole groups on every data-parallel rank
                pruned += 1
                continue
            if req.gpu is None:
                fitting.append(_Scored(c, None, None, None))
                continue
            c, (mem, task_mem) = fit_memory(c, fixed, req.native_trainer, usable, _memory_of(req), req.shape.layers)
            sc = _Scored(c, mem, None, None, task_mem)
            if smallest_by_family.get(fam) is None or mem.total_gib < smallest_by_family[fam].mem.total_gib:
                smallest_by_family[fam] = sc
            if overall_min is None or mem.total_gib < overall_min.mem.total_gib:
                overall_min = sc
            if mem.total_gib > usable:
                pruned += 1
                continue
            _time(req, sc, eff)
            fitting.append(sc)
            b = best_by_family.get(fam)
            if b is None or _better(sc, b):
                best_by_family[fam] = sc
    if considered == 0 or (not fitting and overall_min is None):
        reasons = "; ".join(f"{k}: {v}" for k, v in list(fam_rejected.items())[:8]) or "no layout matches the pins"
        raise PlanError(f"no valid layout for {req.shape.name} on world size {req.world}: {reasons}")
    if req.gpu is None:
        return _cpu_report(req, fitting, fam_rejected, considered, evaluated)
    rejected = [Rejection(layout=k, reason=v) for k, v in fam_rejected.items()]
    if not fitting:
        counts = (considered, pruned, evaluated)
        return _nothing_fits(req, overall_min, smallest_by_family, rejected, counts, eff, usable)
    ranked = sorted(best_by_family.values(), key=_key)
    best = ranked[0]
    for fam, sm in smallest_by_family.items():
        if fam in best_by_family:
            if best_by_family[fam] is not best:
                other = best_by_family[fam]
                reason = f"{_lost_by(best, other)} (best: {_knob_str(other.c)})"
                rejected.append(Rejection(layout=fam, reason=reason))
        else:
            rejected.append(Rejection(layout=fam, reason=_nofit(sm, usable)))
    rejected.sort(key=lambda r: (_REASON_ORDER.get(r.reason.split(" ")[0], 2), _pct(r.reason)))
    chosen = _plan_from(req, best, eff)
    chosen.explanation = _explain(req, best, eff, ranked[1] if len(ranked) > 1 else None)
    if evaluated:
        chosen.explanation.insert(0, "evaluated the pinned layout " + _pins(fixed) + "; free knobs searched")
    chosen.rejected = rejected[:20]
    alts = [_plan_from(req, s, eff) for s in ranked[1 : 1 + req.alternatives]]
    return _report(req, chosen, alts, rejected, (considered, pruned, evaluated), eff, overall_min, usable, best.split)


def _schedules(fixed: FixedLayout, pp: int, v: int) -> list[str]:
    """The pipeline schedules a candidate with v chunks per rank runs: the pinned one, else 1F1B (v = 1) or
    interleaved 1F1B, and with two chunks a rank also the V-shaped zero-bubble schedule (not for a forced per-rank
    split, which is placed looped)."""
    if pp == 1:
        return ["1f1b"]
    if fixed.schedule is not None:
        return [fixed.schedule]
    if v == 1:
        return ["1f1b"]
    return ["interleaved_1f1b", "zbv"] if v == 2 and fixed.stages is None else ["interleaved_1f1b"]


def _key(s: _Scored):
    """Fastest first; near-ties (equal to 4 significant digits) go to no activation offload (no host memory, no
    PCIe traffic), then to the smaller memory footprint."""
    return (-float(f"{s.tokens_per_s:.4g}"), s.c.offload_layers > 0, s.mem.total_gib)


def _better(a: _Scored, b: _Scored) -> bool:
    return _key(a) < _key(b)


#: rejected families listed as fast as the chosen first, then slower ones, then those that do not fit
_REASON_ORDER = {"as": 0, "slower": 1}


def _lost_by(best: _Scored, other: _Scored) -> str:
    """Why `other` lost to `best`: 'slower by 4.9%', or, when their speed is the same to the 0.1% printed (the
    search ranks near-ties by memory), 'as fast, more memory: 59.8 vs 45.7 GiB per GPU'."""
    slower = 100 * (best.tokens_per_s / other.tokens_per_s - 1)
    if round(slower, 1) > 0:
        return f"slower by {slower:.1f}%"
    more = other.mem.total_gib - best.mem.total_gib
    if round(more, 1) > 0:
        return f"as fast, more memory: {other.mem.total_gib:.1f} vs {best.mem.total_gib:.1f} GiB per GPU"
    return "as fast, same memory (either runs; the first found is kept)"


def _pct(reason: str) -> float:
    try:
        return float(reason.split("by ")[1].split("%")[0])
    except (IndexError, ValueError):
        return 0.0


def _knob_str(c: ParallelDims) -> str:
    split = f", stages={stages_text(c.stages)}" if c.stages is not None else ""
    ep = f", ep={c.ep}" if c.ep > 1 else ""
    ep += ", reduce-scatter each micro-batch" if c.reduce_each_micro_batch else ""
    ep += f", offload {plural(c.offload_layers, 'layer')}" if c.offload_layers else ""
    ep += ", schedule zbv" if c.schedule == "zbv" else ""
    return (
        f"mb={c.micro_batch}, accum={c.grad_accum}, v={c.virtual_stages}, sp={int(c.sp)}, recompute={c.recompute}"
        + ep
        + split
    )


def _nofit(s: _Scored, usable: float) -> str:
    return (
        f"does not fit by {s.mem.total_gib - usable:.1f} GiB (needs {s.mem.total_gib:.1f} GiB at best, "
        f"{_knob_str(s.c)}; {usable:.1f} GiB usable)"
    )


def _pins(f: FixedLayout) -> str:
    return ",".join(f"{k}={stages_text(v) if k == 'stages' else v}" for k, v in vars(f).items() if v is not None)


def _cpu_report(
    req: PlanRequest, cands: list[_Scored], fam_rejected: dict[str, str], considered: int, evaluated: bool
) -> PlanReport:
    """CPU ranks: no datasheet peak, so nothing is predicted; pick the simplest runnable layout.

    Tiny models on CPU gain nothing from sharding (gloo all-gathers cost more than the memory they save), so
    pure replicated data parallel comes first, then the fewest model-parallel degrees, then fewest micro-steps."""

    def key(s: _Scored):
        c = s.c
        return (
            c.tp * c.pp * c.cp,
            c.pp,
            c.tp,
            c.zero != "none",
            c.sp,
            c.recompute != "none",
            c.virtual_stages,
            c.stages is not None,
            c.grad_accum,
        )

    ranked = sorted(cands, key=key)
    best = ranked[0]
    chosen = _plan_from(req, best, None)
    c = best.c
    chosen.explanation = [
        (
            f"{req.shape.name} on {req.world} CPU ranks ({plural(req.nodes, 'node')} × {req.gpus_per_node}): no datasheet peak, "
            "so memory, step time and MFU are not predicted (the trainer measures a CPU matmul peak at run time)"
        ),
        (
            f"chose {chosen.layout()} mb={c.micro_batch} accum={c.grad_accum}: pure data parallel is preferred for tiny "
            "models on CPU (no sharding traffic); tp stays within a node and divides heads/kv heads"
        ),
    ]
    if evaluated:
        chosen.explanation.insert(0, "evaluated the pinned layout; predictions not made on CPU")
    rejected = [Rejection(layout=k, reason=v) for k, v in fam_rejected.items()]
    chosen.rejected = rejected[:20]
    seen, alts = {chosen.layout()}, []
    for s in ranked[1:]:
        p = _plan_from(req, s, None)
        if p.layout() not in seen and len(alts) < req.alternatives:
            seen.add(p.layout())
            alts.append(p)
    return _report(req, chosen, alts, rejected, (considered, len(fam_rejected), evaluated))


def _report(
    req,
    chosen,
    alternatives,
    rejected,
    counts: tuple[int, int, int],
    eff=None,
    overall_min=None,
    usable=None,
    split=None,
) -> PlanReport:
    """The search's outcome: the chosen plan (or the smallest that did not fit), alternatives, the counts and a
    post-training step's split; on CPU ranks (no GPU) nothing predicted."""
    considered, pruned, evaluated = counts
    return PlanReport(
        chosen=chosen,
        alternatives=alternatives,
        rejected=rejected,
        considered=considered,
        pruned=pruned,
        evaluated=evaluated,
        predicted=req.gpu is not None,
        model=req.shape.name,
        gpu=req.gpu.name if req.gpu else "cpu",
        world_size=req.world,
        efficiency=eff,
        min_memory_gib=overall_min.mem.total_gib if overall_min else None,
        usable_memory_gib=usable,
        post_training=split,
    )
