"""ParallelDims and ParallelPlan: the layout records shared by planner, trainer and ledger.

All rank arithmetic lives here (mesh order, degrees, the data-parallel size), following torchtitan's
ParallelDims: degrees are validated against the world size with messages that print the values, and the
DeviceMesh is built lazily (torch is imported only by `build_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]

#: mesh dimension order, outermost first: pp spans nodes, tp stays innermost (fastest links).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message prints the offending values."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel axis; their product must equal the world size."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = False

    def __post_init__(self) -> None:
        degrees = dict(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, pp=self.pp, cp=self.cp)
        bad = {k: v for k, v in degrees.items() if v < 1}
        if bad:
            raise LayoutError(f"parallel degrees must be >= 1, got {bad}")
        prod = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp
        if prod != self.world_size:
            raise LayoutError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * tp({self.tp}) * pp({self.pp}) "
                f"* cp({self.cp}) = {prod} != world_size({self.world_size})"
            )
        if self.sp and self.tp == 1:
            raise LayoutError("sequence parallel (sp=True) needs tp > 1, got tp=1")

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    def check_model(self, layers: int, heads: int, kv_heads: int, virtual_stages: int = 1) -> None:
        """Divisibility of the model by the layout (raise before any process group starts)."""
        if heads % self.tp or kv_heads % self.tp:
            raise LayoutError(f"heads ({heads}) and kv_heads ({kv_heads}) must be divisible by tp ({self.tp})")
        stages = self.pp * virtual_stages
        if layers % stages:
            raise LayoutError(f"layers ({layers}) must be divisible by pp*virtual_stages ({self.pp}*{virtual_stages})")

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        names = tuple(n for n in MESH_ORDER)
        sizes = tuple(getattr(self, n) for n in MESH_ORDER)
        return names, sizes

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


class MemoryBreakdown(BaseModel):
    """Predicted bytes per GPU on the busiest pipeline stage."""

    model_config = ConfigDict(extra="forbid")
    weights_gib: float = 0.0
    grads_gib: float = 0.0
    optimizer_gib: float = 0.0
    activations_gib: float = 0.0
    overhead_gib: float = 0.0

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.overhead_gib


class Rejection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    layout: str
    reason: str


class ParallelPlan(BaseModel):
    """A chosen layout plus what the planner predicts for it. The trainer needs only the first block."""

    model_config = ConfigDict(extra="forbid")
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
    zero: Literal["none", "fsdp"] = "fsdp"
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

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp_replicate * self.dp_shard * self.cp

    def dims(self) -> ParallelDims:
        return ParallelDims(self.world_size, self.dp_replicate, self.dp_shard, self.tp, self.pp, self.cp, self.sp)

    def layout(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.dp_replicate > 1:
            parts.append(f"DPr{self.dp_replicate}")
        parts.append(f"DP{self.dp_shard}" if self.zero == "none" else f"FSDP{self.dp_shard}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.sp:
            parts.append("SP")
        return "·".join(parts)
