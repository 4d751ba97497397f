"""Loss parity of every layout against the single-process reference: same model, seed, data; 5 AdamW steps."""

from __future__ import annotations

import pytest

from tests.support.harness import STEPS, launch, make_job

TOL = 1e-5

# (id, processes, plan): every plan has global batch micro_batch * grad_accum * dp = 8
LAYOUTS = [
    ("dp2_fsdp", 2, {"dp_shard": 2, "micro_batch": 2, "grad_accum": 2}),
    ("tp2_sp", 2, {"tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 4}),
    ("pp2_1f1b", 2, {"pp": 2, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}),
    (
        "pp2_interleaved",
        2,
        {"pp": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b", "micro_batch": 2, "grad_accum": 4},
    ),
    ("pp2_dp2_gpipe", 4, {"pp": 2, "dp_shard": 2, "schedule": "gpipe", "micro_batch": 2, "grad_accum": 2}),
    ("pp2_tp2_sp", 4, {"pp": 2, "tp": 2, "sp": True, "schedule": "1f1b", "micro_batch": 2, "grad_accum": 4}),
    (
        "hsdp2_tp2_selective",
        4,
        {"dp_replicate": 2, "tp": 2, "recompute": "selective", "micro_batch": 2, "grad_accum": 2},
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
    ),
    pytest.param(
        "dp2_pp2_tp2_sp",
        8,
        {"dp_shard": 2, "pp": 2, "tp": 2, "sp": True, "micro_batch": 2, "grad_accum": 2},
        marks=pytest.mark.slow,
        id="dp2_pp2_tp2_sp",
    ),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,nproc,plan", LAYOUTS, ids=[c[0] if isinstance(c, tuple) else c.id for c in LAYOUTS])
def test_layout_matches_single_process(name, nproc, plan, corpus, reference, tmp_path):
    job = make_job(tmp_path / name, corpus, steps=STEPS, **plan)
    out = launch(nproc, job, timeout=280)
    assert len(out.losses) == STEPS, out.output[-3000:]
    diff = max(abs(a - b) for a, b in zip(out.losses, reference.losses))
    print(f"{name}: max |loss - ref| = {diff:.2e}")
    assert diff <= TOL, (out.losses, reference.losses)
    # every step logged the contract fields
    m = out.metrics[-1]
    assert m.tokens == 8 * 32 and m.mfu is not None and m.mfu > 0 and m.peak_mem_bytes > 0 and m.grad_norm > 0
