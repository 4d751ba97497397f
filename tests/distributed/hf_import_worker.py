"""torchrun worker for test_hf_import: for each layout in turn (one process group, one mesh per layout), parallelize,
load Hugging Face weights into the shards, compare every parameter's full tensor with the file's tensor (a
single-process read), save a native DCP checkpoint under CKPT_ROOT/<layout>. One launch serves every layout: on a
2-core machine a torchrun start costs more than the checks.

`python -m torch.distributed.run --nproc-per-node=2 tests/distributed/hf_import_worker.py FOLDER LAYOUTS_JSON CKPT_ROOT`
(LAYOUTS_JSON: {"name": {ParallelPlan fields}, ...})"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from nightloom.hf.config import shape_from_hf_config
from nightloom.hf.load import load_hf_weights, scan_checkpoint
from nightloom.hf.names import to_hf
from nightloom.parallel import ParallelPlan
from nightloom.train import checkpoint
from nightloom.train.parallelize import build_parts


def main(folder: str, layouts_json: str, ckpt_root: str) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for name, plan in json.loads(layouts_json).items():
        check_layout(folder, name, ParallelPlan(**plan), Path(ckpt_root) / name)
    dist.destroy_process_group()
    return 0


def check_layout(folder: str, layout: str, plan: ParallelPlan, ckpt: Path) -> None:
    rank = dist.get_rank()
    dims = plan.dims()
    mesh = dims.build_mesh("cpu")
    shape = shape_from_hf_config(folder)
    if plan.tp > 1 and shape.vocab % plan.tp:
        shape = shape.padded_for_tp(plan.tp)
    parts = build_parts(shape, plan, dims, mesh, 32, 99, torch.device("cpu"), None)
    index = load_hf_weights(parts.parts, folder, shape)
    checked = 0
    for m in parts.parts:
        for name, p in m.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            hf = to_hf(name)
            with safe_open(str(Path(folder) / index.tensors[hf].file), framework="pt") as f:
                ref = f.get_tensor(hf)
            if full.shape[0] != ref.shape[0] and name in ("tok_embeddings.weight", "output.weight"):
                assert not full[ref.shape[0] :].any(), f"{name}: padded rows are not zero"
                full = full[: ref.shape[0]]
            assert torch.equal(full, ref), f"rank {rank}: {name} differs from {hf} in the file"
            if isinstance(p, DTensor):  # no rank holds a whole sharded tensor
                assert p.to_local().numel() < ref.numel() or all(pl.is_replicate() for pl in p.placements), name
            checked += 1
    assert scan_checkpoint(folder, shape.with_(padded_vocab=0)).tensors
    optims = [torch.optim.AdamW(m.parameters()) for m in parts.parts]
    checkpoint.save(ckpt, 0, parts.parts, optims, rank)
    print(f"{layout} rank {rank}: {checked} parameters equal the file's tensors", flush=True)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
