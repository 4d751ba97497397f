"""Uneven pipeline stages: the trainer splits layers as the plan's `stages` say, with loss parity to one process."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import STEPS
from tests.distributed.harness import launch, make_job

TOL = 1e-5

# tiny has 4 layers; every plan has global batch micro_batch * grad_accum * dp = 8
LAYOUTS = [
    ("pp2_3+1", 2, {"pp": 2, "stages": [3, 1], "micro_batch": 2, "grad_accum": 4}),
    ("pp3_1+2+1", 3, {"pp": 3, "stages": [1, 2, 1], "micro_batch": 2, "grad_accum": 4}),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,nproc,plan", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_uneven_stages_match_single_process(name, nproc, plan, corpus, reference, tmp_path):
    job = make_job(tmp_path / name, corpus, steps=STEPS, **plan)
    out = launch(nproc, job, timeout=280)
    assert len(out.losses) == STEPS, out.output[-3000:]
    diff = max(abs(a - b) for a, b in zip(out.losses, reference.losses))
    print(f"{name}: max |loss - ref| = {diff:.2e}")
    assert diff <= TOL, (out.losses, reference.losses)
    # the trainer keeps, per stage, the layer ranges ParallelDims.stage_bounds gives (unit test below)


def test_uneven_stages_are_checked_before_launch():
    from nightloom.catalog import get_model
    from nightloom.parallel import LayoutError, ParallelPlan
    from nightloom.train.parallelize import validate_plan

    tiny = get_model("tiny")
    ok = ParallelPlan(pp=3, stages=[1, 2, 1], micro_batch=2, grad_accum=4)
    dims = validate_plan(tiny, ok, 32, 8, 3, "cpu")
    assert dims.stage_bounds(4) == [(0, 1), (1, 3), (3, 4)]
    assert ParallelPlan(pp=2, stages=[3, 1]).dims().stage_bounds(4) == [(0, 3), (3, 4)]
    assert ParallelPlan(pp=2, micro_batch=2, grad_accum=4).dims().stage_bounds(4) == [(0, 2), (2, 4)]
    bad = ParallelPlan(pp=2, stages=[3, 2], micro_batch=2, grad_accum=4)
    with pytest.raises(LayoutError, match=r"stages \[3, 2\] must be pp\*virtual_stages \(2\*1\) sizes"):
        validate_plan(tiny, bad, 32, 8, 2, "cpu")
