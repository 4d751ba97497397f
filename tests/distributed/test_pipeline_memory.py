"""Per pipeline rank, the planner's activation bytes (planner/stage_memory.py over planner/activations.py) equal
what the trainer's ranks really hold at their peak, within 5%, for every schedule the trainer offers (GPipe, 1F1B,
interleaved 1F1B, with Llama 3's empty end chunks, the V-shaped zero-bubble schedule), under TP with and without sequence parallel, with activation
offload (parallel.offload_layers: what is on the device, and on the host against planner/offload.py): one 4-process
gloo launch (tests/distributed/pipeline_memory_worker.py), the second step of each layout metered with saved-tensor
hooks and the stages' boundary tensors (train/pipeline_memory.py)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.harness import ROOT, env, torchrun_prefix

OFFLOAD = {"micro_batch": 2, "grad_accum": 4, "offload_layers": 1}
LAYERS = {"layers": 8}  # tiny's width (h 64, 4 heads, 2 KV heads, SwiGLU 176, vocab 256), 8 layers
CASES = [
    ("pp4_gpipe", {"pp": 4, "schedule": "gpipe", "micro_batch": 2, "grad_accum": 4}),
    ("pp4_1f1b", {"pp": 4, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 8}),
    (
        "pp4_interleaved",
        {"pp": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2, "micro_batch": 2, "grad_accum": 8},
    ),
    ("pp2_tp2_sp_1f1b", {"pp": 2, "tp": 2, "sp": True, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}),
    # the same with torch's TP saving the linears' all-gathered inputs (train/sp_shard.py off): the drop measured
    ("pp2_tp2_sp_gathered", {"pp": 2, "tp": 2, "sp": True, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}),
    # an embedding-only first chunk and a head-only last one (Llama 3 405B's ends), TP without SP
    (
        "pp2_tp2_interleaved_ends",
        {"pp": 2, "tp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2, "stages": [0, 4, 4, 0]}
        | {"micro_batch": 2, "grad_accum": 4},
    ),
    # the V-shaped zero-bubble schedule: two chunks a rank, each micro-batch held from its forward to its weight pass
    ("pp4_zbv", {"pp": 4, "schedule": "zbv", "virtual_stages": 2, "micro_batch": 2, "grad_accum": 8}),
    # parallel.offload_layers (train/offload.py): each rank's first layer in host memory; under TP+SP its saved
    # DTensors move as their shards; with one layer after it the one brought back for backward tops the peak
    ("pp2_tp2_sp_1f1b_offload", {"pp": 2, "tp": 2, "sp": True, "schedule": "1f1b"} | OFFLOAD),
    ("pp4_1f1b_offload", {"pp": 4, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 8, "offload_layers": 1}),
]
GRAD_CASES = [  # FSDP2 under PP: gradients reduce-scattered after the last micro-batch (torch's default), or each
    ("pp2_fsdp2_1f1b", {"pp": 2, "dp_shard": 2, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}),
    (
        "pp2_fsdp2_each",
        {"pp": 2, "dp_shard": 2, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}
        | {"reduce_each_micro_batch": True},
    ),
]
SEQ = 64


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline-memory")
    cases = [
        {"name": n, "plan": p, "shape": LAYERS, "seq": SEQ, "gathered_sp": n.endswith("gathered")}
        for n, p in CASES + GRAD_CASES
    ]
    cmd = [*torchrun_prefix(4), str(ROOT / "tests/distributed/pipeline_memory_worker.py"), json.dumps(cases), str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=280, check=False)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    return {f.stem: json.loads(f.read_text()) for f in out.iterdir()}  # "<case>.<rank>"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,plan", CASES, ids=[c[0] for c in CASES])
def test_planner_equals_each_ranks_measured_peak(name, plan, measured):
    from nightloom.catalog import get_model
    from nightloom.parallel import ParallelPlan
    from nightloom.planner.activations import activation_bytes_per_layer
    from nightloom.planner.stage_memory import rank_activation_bytes

    c = ParallelPlan(**plan).dims()
    shape = get_model("tiny").with_(**LAYERS)
    # the run is fp32 (CPU): every saved tensor at 4 bytes, twice the 16-bit count
    gathered = name.endswith("gathered")
    layer = 2 * activation_bytes_per_layer(shape, SEQ, c.micro_batch, c.tp, c.sp, c.recompute, gathered_sp=gathered)
    predicted = rank_activation_bytes(shape, c, SEQ, layer, 4)
    readings = [measured[f"{name}.{r}"] for r in range(4)]
    for rank, r in enumerate(readings):
        p = predicted[r["pp_rank"]]
        print(f"{name} rank {rank} (pp {r['pp_rank']}): measured {r['peak']} predicted {p:.0f} ({p / r['peak']:.4f})")
        assert p == pytest.approx(r["peak"], rel=0.05), (name, rank, r, p)
    # what the boundary keeps at the peak: a receive buffer per chunk at most, not one per micro-batch for the whole
    # run as torch's own PipelineStage keeps (train/pipeline_stage.LeanStage)
    boundary = SEQ * c.micro_batch * shape.hidden * 4 / (c.tp if c.sp else 1)
    for r in readings:
        for kind in ("recv", "grad_recv"):
            assert r["boundary_kinds"].get(kind, 0) <= c.chunks_per_rank * boundary, (kind, r)
        # a sent output keeps no data (LeanStage frees it, as Megatron's deallocate_output_tensor): 1 element each,
        # and at most the one just computed, not yet sent (the last chunk's output is the logits, the head's term)
        # (zbv's turn: rank pp - 1 hands chunk pp - 1's output to chunk pp itself, no send, one more kept)
        turn = 2 if c.schedule == "zbv" and r["pp_rank"] == c.pp - 1 else 1
        if c.chunk_rank(c.pp * c.chunks_per_rank - 1) != r["pp_rank"]:
            assert r["boundary_kinds"].get("output", 0) <= turn * boundary + 4 * c.grad_accum * c.chunks_per_rank, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n, _ in CASES if n.endswith("offload")])
def test_offloaded_layers_wait_on_the_host(name, measured):
    """What each rank's offloaded layers keep in host memory at its peak is the planner's: their saved bytes for
    every micro-batch in flight but the chunk's input (planner/offload.py); every group came back ahead of its
    backward, none is left."""
    from nightloom.catalog import get_model
    from nightloom.planner.activations import activation_bytes_per_layer
    from nightloom.planner.offload import host_bytes
    from nightloom.planner.stage_memory import chunk_input_bytes

    c = _dims(dict(CASES)[name])
    shape = get_model("tiny").with_(**LAYERS)
    layer = 2 * activation_bytes_per_layer(shape, SEQ, c.micro_batch, c.tp, c.sp, c.recompute)
    host = host_bytes(shape, c, layer, chunk_input_bytes(shape, c, SEQ, "fp32"))
    for rank in range(4):
        r = measured[f"{name}.{rank}"]
        print(f"{name} rank {rank}: host peak {r['host_peak']} predicted {host[r['pp_rank']]:.0f}")
        assert r["host_peak"] == pytest.approx(host[r["pp_rank"]], rel=0.05), (rank, r)
        assert r["late"] == 0 and r["host_left"] == 0, r


def test_sp_linears_save_the_shard_not_the_gathered_input(measured):
    """What train/sp_shard.py saves per rank: the drop from torch's gathered saves equals the planner's (a)."""
    from nightloom.catalog import get_model
    from nightloom.planner.activations import activation_bytes_per_layer
    from nightloom.planner.inflight import in_flight_layers

    c = _dims(dict(CASES)["pp2_tp2_sp_1f1b"])
    shape = get_model("tiny").with_(**LAYERS)
    per_layer = [
        2 * activation_bytes_per_layer(shape, SEQ, c.micro_batch, c.tp, True, "none", gathered_sp=g) for g in (1, 0)
    ]
    held = in_flight_layers(c.stage_sizes(shape.layers), c.pp, c.grad_accum, c.schedule)
    for rank in range(4):
        shard, gathered = measured[f"pp2_tp2_sp_1f1b.{rank}"], measured[f"pp2_tp2_sp_gathered.{rank}"]
        drop = gathered["saved_peak"] - shard["saved_peak"]
        predicted = held[shard["pp_rank"]] * (per_layer[0] - per_layer[1])
        print(
            f"rank {rank}: saved peak {gathered['saved_peak']} -> {shard['saved_peak']}, drop {drop} ({predicted:.0f})"
        )
        assert drop == pytest.approx(predicted, rel=0.05), (rank, drop, predicted)


def _dims(plan: dict):
    from nightloom.parallel import ParallelPlan

    return ParallelPlan(**plan).dims()


def test_reduce_each_micro_batch_holds_no_unsharded_gradients(measured):
    """parallel.reduce_each_micro_batch under PP (train/pipeline_stage.LeanStage): FSDP2 keeps no unsharded fp32
    gradients between micro-batches where torch's schedule keeps the stage's (ACCUM_GRAD_BYTES each parameter, what
    the planner prices), and the step's gradients are the same."""
    from nightloom.catalog import get_model
    from nightloom.planner.memory import ACCUM_GRAD_BYTES, rank_params

    c = _dims(dict(GRAD_CASES)["pp2_fsdp2_1f1b"])
    stage_params = rank_params(get_model("tiny").with_(**LAYERS), c)
    for rank in range(4):
        last, each = measured[f"pp2_fsdp2_1f1b.{rank}"], measured[f"pp2_fsdp2_each.{rank}"]
        print(f"rank {rank}: unsharded gradients held {last['accum_grad_peak']} -> {each['accum_grad_peak']} bytes")
        assert last["accum_grad_peak"] == pytest.approx(stage_params[last["pp_rank"]] * ACCUM_GRAD_BYTES, rel=0.02)
        assert each["accum_grad_peak"] == 0
        assert each["grad_sq"] == pytest.approx(last["grad_sq"], rel=1e-5)
