"""Ranks materialise only their own shards: TP/FSDP are applied on the meta device before to_empty + init.

A 2-process FSDP (and TP) build of a 113M-parameter model (432 MiB in fp32): each rank's peak RSS may grow by its half
plus one full parameter (the init draws each parameter whole), never by the whole model, and its local shards
hold exactly half the elements. The values are checked against a single-process build elsewhere (parity tests).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.harness import env, free_port

SCRIPT = r"""
import json, os, resource, torch, torch.distributed as dist
from nightloom.shape import ModelShape
from nightloom.parallel import ParallelPlan
from nightloom.train.parallelize import build_parts
from nightloom.train.model import build_model, param_count

dist.init_process_group("gloo")
shape = ModelShape(name="init-probe", layers=8, hidden=512, heads=8, kv_heads=8, ffn_hidden=8192, vocab=4096,
                   max_seq=64)
plan = ParallelPlan(**json.loads(os.environ["PLAN"]))
dims = plan.dims()
mesh = dims.build_mesh("cpu")
from torch.distributed.fsdp import fully_shard  # noqa: F401  imports and a meta build are not the model's memory
from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401
build_model(shape, 64, device="meta")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
parts = build_parts(shape, plan, dims, mesh, 64, 7, torch.device("cpu"), None)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for m in parts.parts for p in m.parameters())
full = param_count(build_model(shape, 64, device="meta"))
largest = max(p.numel() for p in build_model(shape, 64, device="meta").parameters())
print("PROBE", json.dumps({"rank": dist.get_rank(), "grown": grown, "local": local, "full": full,
                           "largest": largest}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", [{"dp_shard": 2, "zero": "fsdp"}, {"tp": 2}], ids=["fsdp2", "tp2"])
def test_each_rank_materialises_only_its_shards(tmp_path, plan):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
    ]
    p = subprocess.run(
        cmd, env={**env(), "PLAN": json.dumps(plan)}, capture_output=True, text=True, timeout=280, check=False
    )
    assert p.returncode == 0, p.stderr[-3000:]
    probes = [json.loads(ln.split("PROBE ", 1)[1]) for ln in p.stdout.splitlines() if "PROBE " in ln]
    assert len(probes) == 2
    for r in probes:
        full_bytes, largest_bytes = 4 * r["full"], 4 * r["largest"]
        print(
            f"rank {r['rank']}: peak RSS +{r['grown'] / 2**20:.0f} MiB for a {full_bytes / 2**20:.0f} MiB model "
            f"(local {r['local']:,} of {r['full']:,} elements)"
        )
        assert r["local"] < 0.6 * r["full"]  # half the matrices (norms are replicated under TP)
        # materialising the whole model first (the old order) grows the peak by more than full_bytes
        assert r["grown"] < 0.75 * full_bytes
        assert r["grown"] < 0.5 * full_bytes + 4 * largest_bytes + 48 * 2**20
