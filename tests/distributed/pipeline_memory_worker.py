"""torchrun worker for test_pipeline_memory: for each case in turn (one process group, one mesh per case), build the
trainer's parallelised chunks and pipeline schedule (train/parallelize.build_parts), run one step to warm up (the
stages create their buffers), then meter the second step (train/pipeline_memory.ActivationMeter) and write each
rank's reading to OUT/<case>.<rank>.json.

`python -m torch.distributed.run --nproc-per-node=N tests/distributed/pipeline_memory_worker.py CASES_JSON OUT`
(CASES_JSON: [{"name", "plan": {ParallelPlan fields}, "shape": {ModelShape overrides of tiny}, "seq",
"gathered_sp": keep torch's gathered SP saves}, ...])"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from nightloom.catalog import get_model
from nightloom.parallel import ParallelPlan
from nightloom.train.parallelize import build_parts
from nightloom.train.pipeline_memory import ActivationMeter


def main(cases_json: str, out: str) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for case in json.loads(cases_json):
        measure(case, Path(out))
    dist.destroy_process_group()
    return 0


def measure(case: dict, out: Path) -> None:
    rank = dist.get_rank()
    plan = ParallelPlan(**case["plan"])
    dims = plan.dims()
    shape = get_model("tiny").with_(**case.get("shape", {}))
    seq = case["seq"]
    mesh = dims.build_mesh("cpu")
    gathered = case.get("gathered_sp", False)  # torch's TP as it is: the linears save the gathered SP input
    parts = build_parts(
        shape, plan, dims, mesh, seq, 7, torch.device("cpu"), None, loss_chunk=0, sp_save_shard=not gathered
    )
    g = torch.Generator().manual_seed(0)
    rows = plan.micro_batch * plan.grad_accum
    x = torch.randint(0, shape.vocab, (rows, seq), generator=g)
    y = torch.randint(0, shape.vocab, (rows, seq), generator=g)

    def step():
        losses: list[torch.Tensor] = []
        args = (x,) if parts.has_first else ()
        kwargs = {"target": y, "losses": losses} if parts.has_last else {}
        parts.schedule.step(*args, **kwargs)

    step()
    for m in parts.parts:
        m.zero_grad(set_to_none=True)
    accum = _watch_accumulated_grads(parts)
    offloads = [m.offload for m in parts.parts if m.offload is not None]
    for o in offloads:
        o.stats = type(o.stats)()
    meter = ActivationMeter.over(parts.parts, parts.stages, offloads=offloads)
    with meter:
        step()
    reading = asdict(meter.reading) | {"pp_rank": mesh["pp"].get_local_rank(), "stage_ids": parts.stage_ids}
    reading |= {"host_peak": sum(o.stats.host_peak for o in offloads)}
    reading |= {"late": sum(o.stats.late for o in offloads), "host_left": sum(o.stats.host_bytes for o in offloads)}
    reading |= {"accum_grad_peak": max(accum, default=0), "grad_sq": _grad_sq(parts.parts)}
    (out / f"{case['name']}.{rank}.json").write_text(json.dumps(reading))
    dist.barrier()


def _watch_accumulated_grads(parts) -> list[int]:
    """After every chunk's backward, the bytes of FSDP2's unsharded gradients kept for the next micro-batch
    (its accumulated fp32 copy where the parameters are 16-bit)."""
    seen: list[int] = []
    for st in parts.stages:
        run = st.backward_one_chunk

        def after(*a, _run=run, _mod=st.submod, **kw):
            out = _run(*a, **kw)
            seen.append(sum(g.numel() * g.element_size() for g in _accumulated(_mod)))
            return out

        st.backward_one_chunk = after
    return seen


def _accumulated(model) -> list[torch.Tensor]:
    out = []
    for mod in model.modules():
        state = mod._get_fsdp_state() if hasattr(mod, "_get_fsdp_state") else None
        group = state._fsdp_param_group if state is not None else None
        for p in group.fsdp_params if group else []:  # fp32 (CPU): the unsharded parameter's own .grad
            whole = getattr(p, "_unsharded_param", None)
            out.append(p.unsharded_accumulated_grad if whole is None or whole.grad is None else whole.grad)
    return [g for g in out if g is not None]


def _grad_sq(modules) -> float:
    """Σ grad² over this rank's parameters, whole (a DTensor gradient gathered)."""
    total = 0.0
    for m in modules:
        for p in m.parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                total += float(g.double().pow(2).sum())
    return total


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
