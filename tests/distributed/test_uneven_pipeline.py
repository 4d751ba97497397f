"""Uneven pipeline stages: the trainer splits layers as the plan's `stages` say, with loss parity to one process;
also the ends with no layer (an embedding-only first chunk, a head-only last chunk: Llama 3 405B's one-layer
interleaved chunks, Grattafiori et al. 2024 §3.3.2), untied and tied."""

from __future__ import annotations

import pytest

from tests.support.harness import REF_PLAN, STEPS, launch, make_job

TOL = 1e-5

#: PP2 interleaved, two chunks per rank, the end chunks with no transformer layer
INTERLEAVED_EMPTY_ENDS = {
    "schedule": "interleaved_1f1b",
    "virtual_stages": 2,
    "stages": [0, 2, 2, 0],
    "micro_batch": 2,
    "grad_accum": 4,
}

# tiny has 4 layers; every plan has global batch micro_batch * grad_accum * dp = 8
LAYOUTS = [
    ("pp2_3+1", 2, {"pp": 2, "stages": [3, 1], "micro_batch": 2, "grad_accum": 4}),
    ("pp3_1+2+1", 3, {"pp": 3, "stages": [1, 2, 1], "micro_batch": 2, "grad_accum": 4}),
    # chunk 0 (rank 0) the embedding only, chunk 3 (rank 1) the final norm, head and loss only
    ("pp2_v2_0+2+2+0", 2, {"pp": 2, **INTERLEAVED_EMPTY_ENDS}),
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


@pytest.mark.timeout(400)
def test_tied_model_with_empty_end_chunks_matches_single_process(corpus, tmp_path):
    """`tiny-tied` with an embedding-only first chunk and a head-only last chunk: the two chunks holding the
    tied matrix hold nothing else (train/tied.py sums their gradients); losses equal one process's."""
    reference = launch(1, make_job(tmp_path / "one", corpus, model="tiny-tied", steps=STEPS, **REF_PLAN))
    assert len(reference.losses) == STEPS, reference.output[-3000:]
    job = make_job(tmp_path / "pp2", corpus, model="tiny-tied", steps=STEPS, pp=2, **INTERLEAVED_EMPTY_ENDS)
    out = launch(2, job, timeout=280)
    assert len(out.losses) == STEPS, out.output[-3000:]
    diff = max(abs(a - b) for a, b in zip(out.losses, reference.losses))
    print(f"tied pp2_v2_0+2+2+0: max |loss - ref| = {diff:.2e}")
    assert diff <= TOL, (out.losses, reference.losses)


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
    ends = ParallelPlan(pp=2, **INTERLEAVED_EMPTY_ENDS)
    assert validate_plan(tiny, ends, 32, 8, 2, "cpu").stage_bounds(4) == [(0, 0), (0, 2), (2, 4), (4, 4)]
    inner = ParallelPlan(pp=2, **{**INTERLEAVED_EMPTY_ENDS, "stages": [2, 0, 2, 0]})
    with pytest.raises(LayoutError, match=r"stages \[2, 0, 2, 0\]: chunk 1 = 0; every chunk needs >= 1 layer"):
        validate_plan(tiny, inner, 32, 8, 2, "cpu")
