"""ParallelDims and ParallelPlan: the layout record (degrees, knobs, rules) and the plan record built on it.

All rank arithmetic lives here (mesh order, degrees, the data-parallel size), following torchtitan's
ParallelDims: degrees are validated against the world size with messages that print the values, and the
DeviceMesh is built lazily (torch is imported only by `build_mesh`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Literal, get_type_hints

from pydantic import ConfigDict, Field, create_model, model_validator

from nightloom.records import Record
from nightloom.spec.stage_list import stage_list_errors

Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"]
#: schedules that place several chunks (virtual stages) on every pipeline rank
MULTI_CHUNK = ("interleaved_1f1b", "zbv")
#: how the dp_shard ranks shard: "fsdp" = ZeRO-3 (FSDP2 reshards parameters after forward), "zero2" = ZeRO-2-like
#: (FSDP2 reshard_after_forward=False: gradients and optimizer states sharded, parameters kept gathered from
#: forward to backward); "none" only with dp_shard == 1 (plain data parallel is spelled dp_replicate).
Zero = Literal["none", "fsdp", "zero2"]

#: mesh dimension order, outermost first: pp spans nodes, tp stays innermost (fastest links).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message prints the offending values."""


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """One layout: the degree of every parallel axis and the knobs the layout rules need (the one owner).

    The spec, the planner (its search candidates are ParallelDims) and the trainer build this record and ask
    `check(...)` whether the layout can run; `resolve(...)` fills a `-1` degree from the world size.
    `stages`: transformer layers per pipeline chunk (pp·v chunks, chunk c on pp rank c mod pp) when the split is
    uneven (None: layers / (pp·v) each); the first and last chunk may hold none (`stage_list_errors`).
    `ep`: expert parallel (MoE): each expert lives on one of ep ranks drawn from the data-parallel ranks, as
    torchtitan and Megatron-Core do (not a mesh dim of its own): from dp_shard·cp under FSDP/ZeRO, else from
    dp_replicate·cp; the experts' own FSDP then shards over the rest of those ranks (`expert_shard`)."""

    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    sp: bool = False
    micro_batch: int = 1
    grad_accum: int = 1
    virtual_stages: int = 1
    schedule: Schedule = "1f1b"
    recompute: Recompute = "none"
    zero: Zero = "fsdp"
    stages: tuple[int, ...] | None = None
    ep: int = 1
    #: FSDP2 reduce-scatters every micro-batch's gradients (less memory: no unsharded fp32 gradients held between
    #: micro-batches; more communication), not only the last one's
    reduce_each_micro_batch: bool = False
    #: every pipeline rank (or the one model without PP) keeps what its first n transformer layers save for backward
    #: in host memory until their backward (train/offload.py; the planner: planner/offload.py)
    offload_layers: int = 0

    def __post_init__(self) -> None:
        degrees = {k: getattr(self, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")}
        bad = {k: v for k, v in degrees.items() if v < 1}
        if bad:
            raise LayoutError(f"parallel degrees must be >= 1, got {bad}")
        if self.sp and self.tp == 1:
            raise LayoutError("sequence parallel (sp=True) needs tp > 1, got tp=1")
        if self.zero == "none" and self.dp_shard > 1:
            raise LayoutError(
                f"dp_shard={self.dp_shard} with zero='none' is plain data parallel: spell it "
                f"dp_replicate={self.dp_replicate * self.dp_shard}, dp_shard=1"
            )
        if self.dp_shard == 1 and self.zero != "none":
            object.__setattr__(self, "zero", "none")  # nothing is sharded over one rank

    @classmethod
    def resolve(cls, world_size: int, *, dp_shard: int = -1, **knobs) -> ParallelDims:
        """The layout with `dp_shard=-1` filled by what the other degrees leave of `world_size`."""
        tp, pp, dpr, cp = (knobs.get(k, 1) for k in ("tp", "pp", "dp_replicate", "cp"))
        fixed = tp * pp * dpr * cp
        if dp_shard is None or dp_shard < 1:
            if world_size % fixed:
                raise LayoutError(
                    f"parallel: world size {world_size} is not divisible by tp({tp})·pp({pp})·"
                    f"dp_replicate({dpr})·cp({cp}) = {fixed}"
                )
            dp_shard = world_size // fixed
        elif fixed * dp_shard != world_size:
            raise LayoutError(
                f"parallel: tp({tp})·pp({pp})·dp_replicate({dpr})·dp_shard({dp_shard})·cp({cp}) = "
                f"{fixed * dp_shard} != world size {world_size}"
            )
        return cls(dp_shard=dp_shard, **knobs)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp_replicate * self.dp_shard * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Degree the gradients and optimizer states are divided by (ZeRO-2 and ZeRO-3/FSDP shard over
        dp_shard × cp: context-parallel ranks hold the same parameters); 1 for replicas."""
        return self.dp_shard * self.cp if self.dp_shard > 1 else 1

    @property
    def ep_pool(self) -> int:
        """The data-parallel ranks expert parallel is drawn from: dp_shard·cp when sharded, else dp_replicate·cp."""
        return self.dp_shard * self.cp if self.dp_shard > 1 else self.dp_replicate * self.cp

    @property
    def expert_shard(self) -> int:
        """Degree the experts' gradients and optimizer states are divided by: FSDP over the sharded ranks that
        hold the same experts (shard / ep); 1 for replicas."""
        return self.shard // self.ep if self.dp_shard > 1 else 1

    @property
    def chunks_per_rank(self) -> int:
        """Pipeline chunks (virtual stages) each pp rank holds."""
        return self.virtual_stages if self.schedule in MULTI_CHUNK else 1

    def chunk_rank(self, j: int) -> int:
        """The pipeline rank holding chunk j (`_chunk_rank`)."""
        return _chunk_rank(j, self.pp, self.schedule == "zbv")

    @property
    def head_rank(self) -> int:
        """The pipeline rank holding the output head (the model's last chunk): pp − 1, or under zbv rank 0."""
        return self.chunk_rank(self.pp * self.chunks_per_rank - 1)

    def rank_chunks(self, r: int) -> list[int]:
        """The chunks pipeline rank r holds, in model order."""
        return [j for j in range(self.pp * self.chunks_per_rank) if self.chunk_rank(j) == r]

    def rank_sizes(self, layers: int) -> tuple[int, ...]:
        """Transformer layers each pipeline rank holds (its chunks summed)."""
        return _rank_sizes(self.stage_sizes(layers), self.pp, self.schedule == "zbv")

    def stage_sizes(self, layers: int) -> tuple[int, ...]:
        """Transformer layers of every pipeline chunk, in order (even split unless `stages` is given)."""
        if self.stages is not None:
            return self.stages
        n = self.pp * self.chunks_per_rank
        return (layers // n,) * n

    def stage_bounds(self, layers: int) -> list[tuple[int, int]]:
        """[first, last) global layer indices of every pipeline chunk (what the trainer's stages keep)."""
        sizes = self.stage_sizes(layers)
        starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return list(zip(starts[:-1], starts[1:]))

    def offloaded_per_chunk(self, layers: int) -> tuple[int, ...]:
        """Layers of every pipeline chunk (model order) whose activations are offloaded: each rank's first
        `offload_layers` in model order, its chunks taken in turn (`chunk_rank`)."""
        sizes = self.stage_sizes(layers)
        if not self.offload_layers:  # the usual case, asked ~10^5 times by one search
            return (0,) * len(sizes)
        left = [self.offload_layers] * self.pp
        out = []
        for j, n in enumerate(sizes):
            k = min(n, left[self.chunk_rank(j)])
            left[self.chunk_rank(j)] -= k
            out.append(k)
        return tuple(out)

    def check(
        self,
        shape,
        seq_len: int,
        global_batch: int | None,
        *,
        device_type: str | None = None,
        native_trainer: bool = True,
    ) -> list[str]:
        """Every reason this layout cannot train `shape` (a ModelShape) at `seq_len` × `global_batch`; [] = runs.

        The one rule set: the spec, the planner's pruning and the trainer all call it. `device_type` (the
        trainer's) adds the device rules; `native_trainer=False` drops the rules that are limits of nightloom's
        trainer, not of the layout (what-if predictions for layouts other trainers run)."""
        why: list[str] = []
        t, p = self.tp, self.pp
        bad = [f"{name} ({n})" for name, n in (("heads", shape.heads), ("kv_heads", shape.kv_heads)) if n % t]
        if bad:  # name only the count tp does not divide
            why.append(
                f"{' and '.join(bad)} must be divisible by tp ({t}): tp={t} does not divide "
                + ("them" if len(bad) > 1 else "it")
            )
        if shape.ffn_hidden % t:
            why.append(f"tp={t} does not divide ffn_hidden ({shape.ffn_hidden})")
        why += self._ep_errors(shape)
        if native_trainer:
            why += self.moe_trainer_errors(shape)
        v = self.chunks_per_rank
        why += self._schedule_errors(shape, native_trainer)
        if self.stages is None:
            if shape.layers % (p * v):
                why.append(
                    f"pp={p} does not divide layers ({shape.layers}): layers ({shape.layers}) must be divisible by "
                    f"pp*virtual_stages ({p}*{v}), or give uneven stages=[...]"
                )
        else:
            why += stage_list_errors(self.stages, p * v, shape.layers, f"pp*virtual_stages ({p}*{v})")
        if self.sp and seq_len % t:
            why.append(f"sequence parallel needs seq_len ({seq_len}) divisible by tp ({t})")
        if p > 1:
            if self.grad_accum < p:
                why.append(f"pipeline needs grad_accum (= microbatches, {self.grad_accum}) >= pp ({p})")
            if self.schedule == "interleaved_1f1b" and self.grad_accum % p:
                why.append(f"interleaved 1F1B needs grad_accum ({self.grad_accum}) divisible by pp ({p})")
        if self.cp > 1:
            if device_type is not None and device_type != "cuda":
                why.append(
                    f"context parallel (cp={self.cp}) runs on CUDA only (no CPU sharding rule "
                    "for SDPA); this node has no GPU"
                )
            if native_trainer and p > 1:
                why.append(f"context parallel (cp={self.cp}) with pp ({p}) > 1 is not supported")
            if seq_len % (2 * self.cp):
                why.append(f"context parallel needs seq_len ({seq_len}) divisible by 2*cp ({2 * self.cp})")
            if shape.windowed(seq_len) or shape.rope_local_theta is not None:
                local = ", sliding layers with their own RoPE base" if shape.rope_local_theta is not None else ""
                why.append(
                    f"context parallel (cp={self.cp}) with sliding-window attention (window {shape.sliding_window}, "
                    f"seq_len {seq_len}{local}) is not supported: ring attention runs plain causal SDPA over the "
                    "whole sequence and shards only the global RoPE table"
                )
        if global_batch is not None:
            dp_batch = self.micro_batch * self.grad_accum * self.dp
            if global_batch % self.dp:
                why.append(f"global batch {global_batch} is not divisible by dp={self.dp}")
            elif dp_batch != global_batch:
                why.append(
                    f"train.global_batch ({global_batch}) != micro_batch({self.micro_batch}) * grad_accum"
                    f"({self.grad_accum}) * dp({self.dp}) = {dp_batch}"
                )
        if seq_len > shape.max_seq:
            why.append(f"train.seq_len ({seq_len}) exceeds model {shape.name} max_seq ({shape.max_seq})")
        return why + self._offload_errors(shape.layers)

    def _schedule_errors(self, shape, native_trainer: bool) -> list[str]:
        """The schedule's own rules: virtual stages only where chunks interleave; zbv two chunks a rank, pp > 1."""
        why = []
        if self.schedule not in MULTI_CHUNK and self.virtual_stages != 1:
            why.append(f"virtual_stages={self.virtual_stages} needs schedule 'interleaved_1f1b', got {self.schedule!r}")
        if self.schedule == "zbv" and (self.virtual_stages != 2 or self.pp == 1):
            why.append(
                f"schedule 'zbv' runs two chunks on each of pp > 1 ranks: virtual_stages 2, got {self.virtual_stages}"
            )
        return why

    def _offload_errors(self, layers: int) -> list[str]:
        """offload_layers: at most the most layers a rank holds, and only without recompute (which already keeps less than
        offload would move)."""
        n = self.offload_layers
        if n == 0:
            return []
        if n < 0:
            return [f"offload_layers must be >= 0, got {n}"]
        most = max(self.rank_sizes(layers))
        why = []
        if n > most:  # a rank holding fewer offloads all of its own
            why.append(f"offload_layers ({n}) exceeds the layers a pipeline rank holds ({most})")
        if self.recompute != "none":
            why.append(
                f"offload_layers ({n}) with recompute {self.recompute!r}: offload moves the activations recompute "
                "drops; use recompute 'none' with it"
            )
        return why

    def moe_trainer_errors(self, shape) -> list[str]:
        """What nightloom's trainer does not run for a mixture of experts (train/moe.py), each named: the degrees
        of `moe_degree_errors`, ep dividing dp_shard, and under EP × FSDP the experts' dim 1 (hidden,
        expert_ffn_hidden) split over dp_shard / ep ranks."""
        if not getattr(shape, "num_experts", 0):
            return []
        why = [msg for _, msg in moe_degree_errors(shape, self.tp, self.pp, self.cp, self.ep, self.dp_replicate)]
        if self.ep > 1:
            if self.dp_replicate == 1 and self.dp_shard % self.ep:
                why.append(f"ep={self.ep} must divide dp_shard ({self.dp_shard})")
            rest = self.dp_shard // self.ep if self.dp_shard % self.ep == 0 else 1
            if rest > 1 and (shape.expert_ffn_hidden % rest or shape.hidden % rest):
                why.append(
                    f"dp_shard/ep={rest} must divide the experts' hidden ({shape.hidden}) and expert_ffn_hidden "
                    f"({shape.expert_ffn_hidden}): they are FSDP-sharded on dim 1"
                )
        return why

    def _ep_errors(self, shape) -> list[str]:
        """Expert parallel's rules: an MoE model, ep dividing its experts and the data-parallel ranks it is
        drawn from (dp_shard·cp under FSDP/ZeRO, dp_replicate·cp for replicas)."""
        ep, experts = self.ep, getattr(shape, "num_experts", 0)
        why = []
        if experts and shape.expert_ffn_hidden % self.tp:
            why.append(f"tp={self.tp} does not divide expert_ffn_hidden ({shape.expert_ffn_hidden})")
        if ep == 1:
            return why
        if not experts:
            return why + [f"expert parallel (ep={ep}) needs a mixture-of-experts model; {shape.name} is dense"]
        if experts % ep:
            why.append(f"ep={ep} does not divide the {experts} experts of {shape.name}")
        if self.ep_pool % ep:
            pool = "dp_shard·cp" if self.dp_shard > 1 else "dp_replicate·cp"
            why.append(
                f"ep={ep} must divide the data-parallel ranks it is drawn from: {pool} = {self.ep_pool} "
                f"(dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, cp={self.cp})"
            )
        return why

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        return MESH_ORDER, tuple(getattr(self, n) for n in MESH_ORDER)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on every mesh dim (row-major over MESH_ORDER, as init_device_mesh)."""
        names, sizes = self.mesh_shape()
        out, r = {}, rank
        for name, size in reversed(list(zip(names, sizes))):
            out[name] = r % size
            r //= size
        return out

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def build_mesh(self, device_type: str):
        """The DeviceMesh with every dim named (sizes 1 included) so slicing code never branches."""
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = self.mesh_shape()
        return init_device_mesh(device_type, sizes, mesh_dim_names=names)

    def layout(self) -> str:
        return layout_name(self.tp, self.pp, self.dp_replicate, self.dp_shard, self.cp, self.sp, self.zero, self.ep)


def moe_degree_errors(shape, tp: int, pp: int, cp: int, ep: int, dp_replicate: int) -> list[tuple[str, str]]:
    """(degree, why) for each degree nightloom's trainer does not run a mixture of experts with: TP, PP, CP, and EP
    beside replicas. The one rule: the spec checks (on the raw degrees, naming the field) and
    ParallelDims.moe_trainer_errors (planner, trainer) both ask it."""
    if not getattr(shape, "num_experts", 0):
        return []
    unsupported = (
        ("tp", tp, "tensor parallel"),
        ("pp", pp, "pipeline stage's aux loss"),
        ("cp", cp, "context parallel"),
    )
    why = [
        (
            name,
            f"{name}={n}: a mixture-of-experts model ({shape.arch}) trains with dp_shard and ep only (no {what} for "
            "MoE layers yet)",
        )
        for name, n, what in unsupported
        if n > 1
    ]
    if ep > 1 and dp_replicate > 1:
        why.append(("ep", f"ep={ep} with dp_replicate={dp_replicate}: EP is drawn from dp_shard only"))
    return why


def layout_name(
    tp: int, pp: int, dp_replicate: int, dp_shard: int, cp: int = 1, sp: bool = False, zero: str = "fsdp", ep: int = 1
):
    """Short name of a layout's degrees, e.g. TP8·PP16·DP128 (replicas), TP8·PP1·DPr2·FSDP4·SP (HSDP), ·EP8."""
    parts = [f"TP{tp}", f"PP{pp}"]
    if dp_shard == 1:
        parts.append(f"DP{dp_replicate}")
    else:
        if dp_replicate > 1:
            parts.append(f"DPr{dp_replicate}")
        parts.append(f"{'ZeRO2-' if zero == 'zero2' else 'FSDP'}{dp_shard}")
    if cp > 1:
        parts.append(f"CP{cp}")
    if sp:
        parts.append("SP")
    if ep > 1:
        parts.append(f"EP{ep}")
    return "·".join(parts)


class MemoryBreakdown(Record):
    """Predicted bytes per GPU on the busiest pipeline stage."""

    weights_gib: float = 0.0
    grads_gib: float = 0.0
    optimizer_gib: float = 0.0
    activations_gib: float = 0.0
    overhead_gib: float = 0.0
    host_gib: float = 0.0  # pinned host memory of offloaded activations (parallel.offload_layers), not in the total

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.overhead_gib


class Rejection(Record):
    layout: str
    reason: str


def _chunk_rank(j: int, pp: int, v_shape: bool) -> int:
    """The pipeline rank of chunk j: j mod pp (looped, interleaved 1F1B), or on the V of the zero-bubble schedule
    (zbv: Qi et al. 2024 §6) rank j on the way down and 2·pp − 1 − j on the way back."""
    if v_shape:
        return j if j < pp else 2 * pp - 1 - j
    return j % pp


@functools.lru_cache(maxsize=4096)
def _rank_sizes(sizes: tuple[int, ...], pp: int, v_shape: bool) -> tuple[int, ...]:
    """Layers per pipeline rank, each chunk on its `_chunk_rank`."""
    out = [0] * pp
    for j, n in enumerate(sizes):
        out[_chunk_rank(j, pp, v_shape)] += n
    return tuple(out)


#: the fields of ParallelPlan that are the layout (ParallelDims's fields); the rest are predictions
LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelDims))


def _layout_fields() -> dict[str, tuple[Any, Any]]:
    """ParallelDims's fields as pydantic fields, the same names, types and defaults (stages a list, as in JSON)."""
    hints = get_type_hints(ParallelDims) | {"stages": list[int] | None}
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(ParallelDims)}


#: the layout half of ParallelPlan, declared once: ParallelDims's fields
_PlanLayout = create_model("_PlanLayout", __config__=ConfigDict(extra="forbid"), **_layout_fields())


class ParallelPlan(_PlanLayout):
    """A layout (the fields of ParallelDims, flat for JSON, job files and the ledger) plus what the planner
    predicts for it. The trainer needs only the layout: `dims()`.

    Old plans that spelled plain data parallel `dp_shard=N, zero="none"` are read as `dp_replicate=N` (the
    same ranks: dp_replicate and dp_shard are adjacent mesh dims), with a note in the explanation."""

    model_config = ConfigDict(extra="forbid")
    # predictions (None when not predicted, e.g. CPU)
    memory: MemoryBreakdown | None = None
    memory_gib_per_gpu: float | None = None
    fits: bool | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    tflops_per_gpu_model: float | None = None
    tflops_per_gpu_hardware: float | None = None
    explanation: list[str] = Field(default_factory=list)
    rejected: list[Rejection] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _plain_dp_is_dp_replicate(cls, data):
        if isinstance(data, dict) and data.get("zero") == "none" and (data.get("dp_shard") or 1) > 1:
            n, r = data["dp_shard"], data.get("dp_replicate") or 1
            note = f"read dp_shard={n} with zero=none (replicas, an old spelling) as dp_replicate={n * r}"
            data = {**data, "dp_replicate": n * r, "dp_shard": 1, "explanation": [*data.get("explanation", []), note]}
        return data

    @model_validator(mode="after")
    def _zero_needs_shards(self) -> ParallelPlan:
        if self.dp_shard == 1 and self.zero != "none":
            self.zero = "none"  # nothing is sharded over one rank (as ParallelDims)
        return self

    @classmethod
    def of(cls, dims: ParallelDims, **predictions) -> ParallelPlan:
        """The plan record of a layout (plus any predictions)."""
        d = {k: getattr(dims, k) for k in LAYOUT_FIELDS}
        d["stages"] = list(dims.stages) if dims.stages is not None else None
        return cls(**d, **predictions)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp_replicate * self.dp_shard * self.cp

    def dims(self) -> ParallelDims:
        """The layout as the record every rule and all rank arithmetic lives on (raises LayoutError)."""
        d = {k: getattr(self, k) for k in LAYOUT_FIELDS}
        d["stages"] = tuple(self.stages) if self.stages is not None else None
        return ParallelDims(**d)

    def layout(self) -> str:
        return layout_name(self.tp, self.pp, self.dp_replicate, self.dp_shard, self.cp, self.sp, self.zero, self.ep)
