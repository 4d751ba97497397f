"""Activation offload (parallel.offload_layers): what chosen transformer layers save for backward waits in host
memory instead of on the GPU, and comes back one layer ahead of its backward.

A pipeline rank's first layers keep their activations longest (their backward comes last), so those are the ones
offloaded (`offloaded_layers`). Every tensor such a layer saves (its parameters and the stage's received input
apart: something else holds them on the device anyway) is copied to pinned host memory on a side stream, and the
GPU copy is released once that copy has run (`record_stream`). When the next layer's backward begins (a hook on its
output's gradient) the layer's tensors are copied back on the side stream; the unpack waits only for that copy.
Megatron-LM's fine-grained activation offloading and torchtitan's do the same with saved-tensor hooks
(`torch.autograd.graph.saved_tensors_hooks`). On a CPU device the copies are clones, so the bookkeeping (which
tensors move, when they come back, the bytes on each side) runs and is tested here; the overlap needs a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nightloom.train.pipeline_memory import storage_of


def offloaded_layers(rank_layers: list[int], n: int) -> set[int]:
    """The `n` layers (global indices) of a pipeline rank whose activations wait longest: its first n in model
    order (every chunk's micro-batches run backward in reverse layer order, the rank's first chunk's last)."""
    return set(sorted(rank_layers)[:n])


@dataclass
class OffloadStats:
    """What moved in a run: bytes to host in all, on host now and at most, and how each group came back."""

    sent_bytes: int = 0
    host_bytes: int = 0
    host_peak: int = 0
    device_bytes: int = 0  # groups brought back and not yet used by their backward
    prefetched: int = 0  # groups copied back ahead of their backward (the next layer's backward began)
    late: int = 0  # groups fetched only when their backward asked (nothing ran after them in the chunk)


@dataclass(eq=False)
class _Group:
    """One layer's saved storages of one micro-batch, as bytes: on host, then back on the device. A storage several
    ops save (a norm's output feeds q, k and v; a view of the attention's output feeds the o projection) is copied
    once; its copies go once every op that saved it has taken it back, or has let it go unused."""

    stats: OffloadStats
    host: list[torch.Tensor | None] = field(default_factory=list)  # uint8, a storage's bytes
    refs: list[int] = field(default_factory=list)  # handles still to use each storage
    index: dict[int, int] = field(default_factory=dict)  # device storage pointer -> its place
    #: the device tensors packed, kept until the layer's forward ends: a pointer names one storage only while it
    #: lives (a freed one's address is soon another tensor's)
    alive: list[torch.Tensor] = field(default_factory=list)
    device: list[torch.Tensor | None] | None = None
    ready: object | None = None  # CUDA event: the copy back has run

    def release(self, i: int) -> None:
        """One handle of storage i is done with it; the last one lets its copies go."""
        self.refs[i] -= 1
        if self.refs[i]:
            return
        n = self.host[i].numel()
        self.host[i] = None
        self.stats.host_bytes -= n
        if self.device is not None:
            self.device[i] = None
            self.stats.device_bytes -= n


class _Handle:
    """What autograd keeps for an offloaded tensor: its group, its storage's place there, and how to view it
    (dtype, offset, size, stride; a DTensor's mesh, placements, shape and stride)."""

    __slots__ = ("dtensor", "group", "index", "used", "view")

    def __init__(self, group: _Group, index: int, view: tuple, dtensor: tuple | None):
        self.group, self.index, self.view, self.dtensor, self.used = group, index, view, dtensor, False
        group.refs[index] += 1

    def __del__(self):
        if not self.used:  # autograd let it go unused (its gradient was not needed)
            self.group.release(self.index)


class ActivationOffload:
    """Saved-tensor hooks for one rank's offloaded layers and the prefetch that brings a layer's tensors back when
    the next layer's backward begins: `run(layer, offloaded, forward)` for every layer of a chunk, in order, then
    `finish(chunk_output)`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.stats = OffloadStats()
        self._last: _Group | None = None  # the offloaded layer just run: the next layer's backward fetches it
        self._shared: set[int] = set()  # storages of the chunk's buffers (begin)
        self.on_fetch = None  # called once a group is back on the device (train/pipeline_memory.py samples then)
        #: (pack, unpack) of saved-tensor hooks outside this one, for the tensors it keeps on the device (torch
        #: applies only the innermost hooks; train/pipeline_memory.py counts the kept ones through these)
        self.outer: tuple | None = None

    def begin(self, model: nn.Module, chunk_input: torch.Tensor) -> None:
        """A chunk's forward starts: its buffers (the RoPE tables every layer slices) and its input (a received
        buffer the stage holds, or the embedding's output) stay on the device."""
        kept = [*model.buffers(), getattr(chunk_input, "_local_tensor", chunk_input)]
        self._shared = {s.data_ptr() for t in kept if (s := storage_of(t)) is not None}

    def run(self, module: nn.Module, offloaded: bool, forward):
        """`forward()` of one layer; with `offloaded` what it saves (its own parameters and buffers apart) goes to
        host memory. The previous offloaded layer's tensors come back when this layer's backward begins."""
        prev, self._last = self._last, None
        if offloaded:
            own = [*module.parameters(), *module.buffers()]
            keep = self._shared | {s.data_ptr() for t in own if (s := storage_of(t)) is not None}
            group = _Group(self.stats)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, keep, t), self._unpack):
                out = forward()
            group.alive.clear()  # the device copies go as the layer's ops let them (on a GPU once copied out)
            group.index.clear()
            self._last = group if group.host else None
        else:
            out = forward()
        self._prefetch_on(out, prev)
        return out

    def finish(self, output: torch.Tensor) -> None:
        """After a chunk's last layer: its last offloaded layer comes back when `output`'s gradient arrives."""
        prev, self._last = self._last, None
        self._prefetch_on(output, prev)

    def _prefetch_on(self, output: torch.Tensor, group: _Group | None) -> None:
        if group is not None and output.requires_grad:
            output.register_hook(lambda grad: self._fetch(group, early=True))

    def _pack(self, group: _Group, keep: set[int], t: torch.Tensor):
        local = getattr(t, "_local_tensor", t)  # a DTensor: its shard moves, its layout is kept to rebuild it
        s = storage_of(local)
        if s is None or s.data_ptr() in keep or type(local) is not torch.Tensor or (t.is_leaf and t.requires_grad):
            # parameters, the chunk's input, wrapped tensors: kept (a detached alias: no output -> node cycle)
            return self.outer[0](t) if self.outer else t.detach()
        view = (local.dtype, local.storage_offset(), tuple(local.shape), local.stride())
        dtensor = (t.device_mesh, t.placements, t.shape, t.stride()) if local is not t else None
        i = group.index.get(s.data_ptr())
        if i is None:  # a storage not yet copied for this layer
            i = group.index[s.data_ptr()] = len(group.host)
            group.host.append(self._to_host(local, s))
            group.alive.append(local)
            group.refs.append(0)
            st = self.stats
            st.sent_bytes += s.nbytes()
            st.host_bytes += s.nbytes()
            st.host_peak = max(st.host_peak, st.host_bytes)
        return _Handle(group, i, view, dtensor)

    def _to_host(self, local: torch.Tensor, s) -> torch.Tensor:
        """`s`'s bytes in (pinned) host memory; on a GPU copied on the side stream."""
        whole = torch.empty(0, dtype=torch.uint8, device=local.device).set_(s, 0, (s.nbytes(),), (1,))
        host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=self.cuda)
        if not self.cuda:
            return host.copy_(whole)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(whole, non_blocking=True)
        local.record_stream(self.stream)  # the GPU copy is reused only once the copy to host has run
        return host

    def _fetch(self, group: _Group, early: bool) -> None:
        if group.device is not None:
            return
        if self.cuda:
            with torch.cuda.stream(self.stream):
                group.device = [h if h is None else h.to(self.device, non_blocking=True) for h in group.host]
                group.ready = torch.cuda.Event()
                group.ready.record(self.stream)
        else:
            group.device = [h if h is None else h.clone() for h in group.host]
        self.stats.device_bytes += sum(h.numel() for h in group.host if h is not None)
        if early:
            self.stats.prefetched += 1
        else:
            self.stats.late += 1
        if self.on_fetch is not None:
            self.on_fetch()

    def _unpack(self, x):
        if not isinstance(x, _Handle):
            return self.outer[1](x) if self.outer else x
        group, i = x.group, x.index
        self._fetch(group, early=False)
        raw = group.device[i]
        if raw is None or x.used:
            raise RuntimeError("parallel.offload_layers: a saved tensor was used twice (backward with retain_graph)")
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(group.ready)
            raw.record_stream(current)
        dtype, offset, size, stride = x.view
        t = torch.empty(0, dtype=dtype, device=raw.device).set_(raw.untyped_storage(), offset, size, stride)
        x.used = True
        group.release(i)  # autograd holds the device copy now, for as long as its backward needs it
        if x.dtensor is None:
            return t
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = x.dtensor
        return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
