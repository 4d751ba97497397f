"""Parity of every layout with a single-process reference written here as a plain PyTorch loop (not the trainer).

Per step: the loss (abs 1e-5) and the pre-clip gradient norm (relative 1e-5); after the last step: every parameter
(read back from the trainer's final DCP checkpoint) and a checksum over all of them. AdamW is invariant to a
constant gradient scale and clipping normalises it, so a layout that summed gradients instead of averaging them
would still match losses; the grad norm sees it, and so does the SGD, no-clip case, whose update is the gradient.
The `tied_*` cases train `tiny-tied` (embedding and head one matrix): one parameter under TP, a copy on the first and
the last pipeline stage whose gradients are summed, and a checkpoint that stores it once (no `output.weight`).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.harness import STEPS, launch_many, make_job

LOSS_TOL = 1e-5
GRAD_NORM_RTOL = 1e-5
SEED, SEQ_LEN, GLOBAL_BATCH = 1234, 32, 8
NO_CLIP = 1e9  # grad_clip must be > 0: a bound no gradient reaches
SGD = {"optimizer": "sgd", "grad_clip": NO_CLIP, "weight_decay": 0.0, "lr": 0.05}
#: final parameters, elementwise: SGD moves them by lr × gradient (seen ≤ 1e-8 apart); AdamW by ~lr × m/√v, which
#: amplifies rounding where a gradient element is tiny (seen ≤ 5e-6 apart over 5 steps)
PARAM_ATOL = {"sgd": 1e-6, "adamw": 1e-5}

# (id, processes, plan, train overrides): every plan has global batch micro_batch * grad_accum * dp = 8; a plan's
# "model" (default tiny) is the catalog model both the layout and its reference train
TIED = {"model": "tiny-tied"}
LAYOUTS = [
    # One case per axis: AdamW+clip for FSDP and 1F1B runs inside the composed cases below (pp2_dp2_gpipe, pp2_tp2_sp)
    ("dp2_fsdp_sgd_noclip", 2, {"dp_shard": 2, "micro_batch": 2, "grad_accum": 2}, SGD),
    ("tp2_sp", 2, {"tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 4}, {}),
    # TP without SP leaves the norms plain tensors beside DTensors: one optimizer group per mesh
    ("tp2_nosp", 2, {"tp": 2, "sp": False, "micro_batch": 2, "grad_accum": 4}, {}),
    ("pp2_1f1b_sgd_noclip", 2, {"pp": 2, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}, SGD),
    (
        "pp2_interleaved",
        2,
        {"pp": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b", "micro_batch": 2, "grad_accum": 4},
        {},
    ),
    # the V-shaped zero-bubble schedule: rank 0 holds the first and the last chunk, backward split into I and W
    ("pp2_zbv", 2, {"pp": 2, "virtual_stages": 2, "schedule": "zbv", "micro_batch": 2, "grad_accum": 4}, {}),
    # tied under zbv: rank 0 holds the embedding and the head's copy (train/tied.LocalTiedCopies sums them locally)
    (
        "tied_pp2_zbv",
        2,
        {**TIED, "pp": 2, "virtual_stages": 2, "schedule": "zbv", "micro_batch": 2, "grad_accum": 4},
        SGD,
    ),
    # FSDP2 reduce-scattering every micro-batch (parallel.reduce_each_micro_batch: LeanStage under the schedule)
    (
        "pp2_dp2_gpipe",
        4,
        {
            "pp": 2,
            "dp_shard": 2,
            "schedule": "gpipe",
            "micro_batch": 2,
            "grad_accum": 2,
            "reduce_each_micro_batch": True,
        },
        {},
    ),
    ("pp2_tp2_sp", 4, {"pp": 2, "tp": 2, "sp": True, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}, {}),
    (
        "hsdp2_tp2_selective",
        4,
        {"dp_replicate": 2, "tp": 2, "recompute": "selective", "micro_batch": 2, "grad_accum": 2},
        {},
    ),
    (
        "tp2_sp_replicate2_full",
        4,
        {
            "tp": 2,
            "sp": True,
            "dp_replicate": 2,
            "zero": "none",
            "recompute": "full",
            "micro_batch": 2,
            "grad_accum": 2,
        },
        {},
    ),
    (
        "replicate2_sgd_noclip",
        2,
        {"dp_replicate": 2, "zero": "none", "micro_batch": 2, "grad_accum": 2},
        SGD,
    ),
    # the mission's hybrid layout in miniature (every axis at once, 8 processes): ~30 s on 2 cores
    ("dp2_pp2_tp2_sp", 8, {"dp_shard": 2, "pp": 2, "tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 2}, {}),
    # tied embeddings: one vocab-sharded parameter under TP; under PP the first and last stage's copies (SGD without
    # clipping moves them by their summed gradient: a copy that missed the other's gradient shows at step 2)
    ("tied_tp2_sp", 2, {**TIED, "tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 4}, {}),
    ("tied_pp2_1f1b_sgd_noclip", 2, {**TIED, "pp": 2, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}, SGD),
    # and without PP (the trainer's own loop)
    ("tied_fsdp2", 2, {**TIED, "dp_shard": 2, "micro_batch": 2, "grad_accum": 2, "reduce_each_micro_batch": True}, {}),
    # pp=4: the pair (first, last) is its own group and the middle stages take no part
    ("tied_pp4", 4, {**TIED, "pp": 4, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}, {}),
    ("tied_pp2_tp2_sp", 4, {**TIED, "pp": 2, "tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 4}, {}),
    (
        "tied_pp2_dp2_interleaved",
        4,
        {
            **TIED,
            "pp": 2,
            "dp_shard": 2,
            "virtual_stages": 2,
            "schedule": "interleaved_1f1b",
            "micro_batch": 1,
            "grad_accum": 4,
        },
        {},
    ),
]


# ---------------------------------------------------------------------------------------------- the reference


class Reference:
    """Per-step losses and pre-clip grad norms, and the final parameters, of one plain single-process loop."""

    def __init__(self, losses: list[float], grad_norms: list[float], params: dict[str, torch.Tensor]):
        self.losses, self.grad_norms, self.params = losses, grad_norms, params


def lr_at(step: int, train) -> float:
    """Linear warmup, then cosine decay to lr·min_lr_ratio at the last step (the schedule TrainSpec documents)."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps - 1))
    return train.lr * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def reference_run(job_path: Path) -> Reference:
    """The job's model, data and hyper-parameters trained in one process: whole global batch, one backward."""
    from nightloom.train.data import PackedWindows
    from nightloom.train.job import TrainJob
    from nightloom.train.model import build_model

    job = TrainJob.model_validate_json(job_path.read_text())
    t = job.train
    model = build_model(job.model, t.seq_len, device="meta")  # a tied model's head is its embedding
    model.to_empty(device="cpu")
    model.init_weights(t.seed)
    params = [p for p in model.parameters()]
    if t.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=t.lr, weight_decay=t.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    data = PackedWindows(job.manifest, t.seq_len, seed=t.seed)
    losses, norms = [], []
    for step in range(t.steps):
        seqs = data.windows(step * t.global_batch, t.global_batch)  # the global batch of step k: windows k·G…
        x, y = seqs[:, :-1], seqs[:, 1:]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        if norm > t.grad_clip:
            for p in params:
                p.grad.mul_(t.grad_clip / (norm + 1e-6))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        norms.append(norm.item())
    stored = {k: v.detach().clone() for k, v in model.state_dict().items() if "rope" not in k}
    if job.model.tied_embeddings:
        del stored["output.weight"]  # the same matrix as the embedding: a checkpoint holds it once
    return Reference(losses, norms, stored)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model state of the trainer's last DCP checkpoint, gathered to full tensors without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    out = run_dir / "final.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / latest, out)
    return {k: v for k, v in torch.load(out, weights_only=True)["model"].items() if "rope" not in k}


def checksum(params: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(Σ p, Σ p²) over every parameter, in float64."""
    return (
        sum(float(p.double().sum()) for p in params.values()),
        sum(float(p.double().pow(2).sum()) for p in params.values()),
    )


@pytest.fixture(scope="session")
def references(corpus, tmp_path_factory):
    """One plain-loop reference per model and optimizer setting, computed on first use."""
    cache: dict[tuple, Reference] = {}

    def get(train: dict, model: str = "tiny") -> Reference:
        key = (model, *sorted(train.items()))
        if key not in cache:
            run = tmp_path_factory.mktemp("plain-ref") / "run"
            job = make_job(run, corpus, model=model, steps=STEPS, train_kw=dict(train))
            cache[key] = reference_run(job)
        return cache[key]

    return get


# ---------------------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def launched(corpus, tmp_path_factory):
    """Every layout of one world size, trained in ONE torchrun launch on first use (a start costs more than a run
    here); then {name: (RunOut, run folder)}."""
    cache: dict[int, dict] = {}

    def get(nproc: int) -> dict:
        if nproc not in cache:
            root = tmp_path_factory.mktemp(f"parity-{nproc}proc")
            jobs = {
                name: make_job(root / name, corpus, steps=STEPS, train_kw=dict(train), **plan)
                for name, n, plan, train in LAYOUTS
                if n == nproc
            }
            runs = launch_many(nproc, list(jobs.values()), timeout=560)
            cache[nproc] = {name: (runs[job], job.parent) for name, job in jobs.items()}
        return cache[nproc]

    return get


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,nproc,plan,train", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_layout_matches_a_plain_single_process_loop(name, nproc, plan, train, references, launched):
    ref = references(train, plan.get("model", "tiny"))
    out, run_dir = launched(nproc)[name]
    assert len(out.losses) == STEPS, out.output[-3000:]
    loss_diff = max(abs(a - b) for a, b in zip(out.losses, ref.losses))
    norms = [m.grad_norm for m in out.metrics]
    norm_rel = max(abs(a - b) / b for a, b in zip(norms, ref.grad_norms))
    print(f"{name}: max |loss - ref| = {loss_diff:.2e}, max rel |grad_norm - ref| = {norm_rel:.2e}")
    assert loss_diff <= LOSS_TOL, (out.losses, ref.losses)
    assert norm_rel <= GRAD_NORM_RTOL, (norms, ref.grad_norms)

    got = final_params(run_dir)
    assert set(got) == set(ref.params), sorted(set(got) ^ set(ref.params))
    atol = PARAM_ATOL[train.get("optimizer", "adamw")]
    total = sum(p.numel() for p in ref.params.values())
    beyond = sum(int(((got[k] - p).abs() > atol).sum()) for k, p in ref.params.items())
    worst = max(float((got[k] - p).abs().max()) for k, p in ref.params.items())
    print(f"{name}: {beyond}/{total} parameter elements beyond {atol:g} (max {worst:.2e})")
    assert beyond == 0, f"{beyond}/{total} elements differ by more than {atol:g} (max {worst:.3g})"
    (s, s2), (rs, rs2) = checksum(got), checksum(ref.params)
    assert s2 == pytest.approx(rs2, rel=1e-5) and s == pytest.approx(rs, abs=1e-5 * math.sqrt(rs2 * total)), (
        (s, s2),
        (rs, rs2),
    )
    # every step logged the contract fields
    m = out.metrics[-1]
    assert m.tokens == GLOBAL_BATCH * SEQ_LEN and m.mfu is not None and m.mfu > 0 and m.peak_mem_bytes > 0


def test_the_reference_sees_gradient_scale(corpus, references, tmp_path):
    """The checks above can fail: summing gradients over 2 DP ranks (2× the mean) leaves AdamW losses almost
    unchanged, but doubles the pre-clip grad norm and moves SGD parameters twice as far."""
    base = references(SGD)
    job = make_job(tmp_path / "scaled", corpus, steps=STEPS, train_kw={**SGD, "lr": SGD["lr"] * 2})
    doubled = reference_run(job)  # SGD with the gradient doubled == SGD at twice the lr
    assert doubled.grad_norms[0] == pytest.approx(base.grad_norms[0], rel=1e-6)  # same first gradient
    worst = max(float((doubled.params[k] - p).abs().max()) for k, p in base.params.items())
    assert worst > 100 * PARAM_ATOL["sgd"]
    assert checksum(doubled.params)[1] != pytest.approx(checksum(base.params)[1], rel=1e-5)


# ---------------------------------------------------------------------------------------------- what each rank holds

SPLITS = [
    ("pp2", 2, {"pp": 2, "micro_batch": 2, "grad_accum": 4}),
    ("hsdp_rep2_shard2", 4, {"dp_replicate": 2, "dp_shard": 2, "micro_batch": 1, "grad_accum": 2}),
    ("replicate2", 2, {"dp_replicate": 2, "zero": "none", "micro_batch": 2, "grad_accum": 2}),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,nproc,plan", SPLITS, ids=[s[0] for s in SPLITS])
def test_layout_splits_parameters_as_it_should(name, nproc, plan, corpus, tmp_path):
    """Local parameter counts per rank: PP gives each stage its own layers (disjoint, covering the model), FSDP and
    HSDP shard every parameter over dp_shard (HSDP keeps dp_replicate copies), replicate keeps a full copy."""
    import json
    import subprocess
    import sys

    from nightloom.catalog import get_model
    from nightloom.train.model import build_model
    from tests.support.harness import ROOT, env

    full = {k: p.numel() for k, p in build_model(get_model("tiny"), SEQ_LEN).named_parameters()}
    job = make_job(tmp_path / name, corpus, steps=1, **plan)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "tests.support.local_params", "--job", str(job)]
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=110, check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    ranks: list[dict[str, int]] = json.loads((tmp_path / name / "local_params.json").read_text())
    assert len(ranks) == nproc
    held = {k: sum(r.get(k, 0) for r in ranks) for k in full}  # elements of each parameter over all ranks
    if name == "pp2":
        a, b = (set(r) for r in ranks)
        assert not a & b and a | b == set(full), sorted(a & b)
        assert "tok_embeddings.weight" in a and "layers.0.attn.wq.weight" in a and "layers.3.attn.wq.weight" in b
        assert all(r[k] == full[k] for r in ranks for k in r)  # a stage holds its layers whole
        assert held == full
    elif name == "replicate2":
        assert all(r == full for r in ranks)  # a full copy on every rank, nothing split
    else:
        copies = plan.get("dp_replicate", 1)
        assert held == {k: copies * n for k, n in full.items()}
        big = [k for k, n in full.items() if n >= 2 * 64]
        assert all(r[k] < full[k] for r in ranks for k in big), "a rank holds a whole matrix under FSDP"
        assert sum(ranks[0].values()) <= sum(full.values()) / 2 + 64 * len(full)
