"""What a rank holds for backward during a training step, measured: every tensor autograd saves and, under
pipeline parallelism, the stages' boundary tensors (received activations and gradients, outputs kept for backward,
input gradients), each storage counted once, and their peak over the step.

The planner's activation model (planner/activations.py per layer, planner/inflight.py per pipeline rank) is
checked against this meter (tests/distributed/test_pipeline_memory.py). Saved tensors are seen through
`torch.autograd.graph.saved_tensors_hooks` (a saved tensor is live from its pack until autograd drops it); the
boundary tensors are read from torch.distributed.pipelining's PipelineStage state before and after every forward
and backward of a chunk and at every pack.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn


def storage_of(t: torch.Tensor):
    """The storage behind `t` (a DTensor's local shard, an AsyncCollectiveTensor's result); None without one."""
    for attr in ("_local_tensor", "elem"):  # tensor subclasses wrap the tensor that holds the bytes
        inner = getattr(t, attr, None)
        if isinstance(inner, torch.Tensor):
            return storage_of(inner)
    try:
        s = t.untyped_storage()
        s.data_ptr()
        return s
    except (RuntimeError, NotImplementedError):
        return None


@dataclass
class MeterReading:
    """Peak bytes of one step on one rank: `peak` (saved tensors and boundary tensors together), the saved tensors'
    and the boundary tensors' shares at that moment, and the saved tensors' own peak."""

    peak: int = 0
    saved_at_peak: int = 0
    boundary_at_peak: int = 0
    saved_peak: int = 0
    boundary_kinds: dict[str, int] = field(default_factory=dict)


@dataclass
class ActivationMeter:
    """Counts the live bytes of saved tensors and pipeline boundary tensors; parameters and buffers never count.

    Use: `meter = ActivationMeter.over(modules, stages)`, then `with meter: <one step>`; `meter.reading`."""

    skip: set[int]
    stages: list = field(default_factory=list)
    reading: MeterReading = field(default_factory=MeterReading)
    _saved: Counter = field(default_factory=Counter)  # storage pointer -> saved tensors referring to it
    _sizes: dict[int, int] = field(default_factory=dict)
    _hooks: object | None = None
    _undo: list = field(default_factory=list)
    #: activation offloads (train/offload.py) whose layers' tensors it counts while they are back on the device
    offloads: list = field(default_factory=list)

    @classmethod
    def over(
        cls, modules: list[nn.Module], stages: list | None = None, offloads: list | None = None
    ) -> ActivationMeter:
        skip = set()
        for m in modules:
            for t in [*m.parameters(), *m.buffers()]:
                s = storage_of(t)
                if s is not None:
                    skip.add(s.data_ptr())
        return cls(skip=skip, stages=list(stages or []), offloads=list(offloads or []))

    def _pack(self, t: torch.Tensor):
        s = storage_of(t)
        if s is None or s.data_ptr() in self.skip or s.nbytes() == 0:
            return t
        key = s.data_ptr()
        self._saved[key] += 1
        self._sizes[key] = s.nbytes()
        self.sample()
        # a detached alias: holding `t` itself would tie a saved output to its own node (output -> grad_fn ->
        # SavedVariable -> output), a cycle no collector sees, which outlives a retain_graph backward (zero-bubble)
        return _Held(t.detach(), key, self)

    def _release(self, key: int) -> None:
        self._saved[key] -= 1
        if self._saved[key] == 0:
            del self._saved[key]
            del self._sizes[key]

    def boundary_storages(self) -> dict[int, tuple[str, int]]:
        """Storages the pipeline stages hold outside autograd's saved tensors: pointer -> (kind, bytes), kind one of
        `recv` (activation receive buffers), `grad_recv` (gradient receive buffers), `output` (a chunk's outputs
        kept for its backward), `input_grad` (gradients of a chunk's inputs, kept until sent or the step's end)."""
        out: dict[int, tuple[str, int]] = {}

        def add(t, kind: str) -> None:
            if isinstance(t, torch.Tensor):
                s = storage_of(t)
                if s is not None and s.data_ptr() not in self.skip:
                    out.setdefault(s.data_ptr(), (kind, s.nbytes()))
                g = t.grad if t.is_leaf else None
                if g is not None:
                    add(g, "input_grad")
            elif isinstance(t, (tuple, list)):
                for x in t:
                    add(x, kind)

        for st in self.stages:
            for outputs, inputs in st.fwd_cache.values():
                add(outputs, "output")
                add(inputs, "recv")
            for grads in st.bwd_cache.values():
                add(grads, "input_grad")
            for infos in st.args_recv_info.values():
                for info in infos:
                    add(info.buffer, "recv")
            for infos in st.grad_recv_info.values():
                for info in infos:
                    add(info.buffer, "grad_recv")
        return out

    def sample(self) -> None:
        """Take the live total now; keep it if it is the step's peak."""
        saved = sum(self._sizes.values()) + sum(o.stats.device_bytes for o in self.offloads)
        kinds: Counter = Counter()
        for key, (kind, n) in self.boundary_storages().items():
            if key not in self._sizes:
                kinds[kind] += n
        boundary = sum(kinds.values())
        r = self.reading
        r.saved_peak = max(r.saved_peak, saved)
        if saved + boundary > r.peak:
            r.peak, r.saved_at_peak, r.boundary_at_peak = saved + boundary, saved, boundary
            r.boundary_kinds = dict(kinds)

    def __enter__(self) -> ActivationMeter:
        self.reading = MeterReading()
        for st in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                orig = getattr(st, name)
                setattr(st, name, self._sampled(orig))
                self._undo.append((st, name))
        for o in self.offloads:  # what an offload brings back counts from then on; what it keeps, as saved
            o.on_fetch, o.outer = self.sample, (self._pack, _unpack)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        self.sample()
        return self

    def _sampled(self, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            self.sample()
            out = fn(*args, **kwargs)
            self.sample()
            return out

        return run

    def __exit__(self, *exc) -> None:
        self.sample()
        self._hooks.__exit__(*exc)
        for st, name in self._undo:
            delattr(st, name)  # the instance attribute goes; the class's method is back
        self._undo.clear()
        for o in self.offloads:
            o.on_fetch, o.outer = None, None


class _Held:
    """A saved tensor while autograd keeps it: its storage counts until autograd drops this object."""

    __slots__ = ("key", "meter", "t")

    def __init__(self, t: torch.Tensor, key: int, meter: ActivationMeter):
        self.t, self.key, self.meter = t, key, meter

    def __del__(self):
        self.meter._release(self.key)


def _unpack(x):
    return x.t if isinstance(x, _Held) else x
