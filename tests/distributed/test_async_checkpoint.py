"""train.async_checkpoint: every step's checkpoint is written by a thread while the next steps train (FSDP2 on 2
ranks). Training is unchanged (the one-process curve), every periodic checkpoint holds the state of its own step
(a resume from step 2 or 3 continues on the reference curve: nothing the next steps changed leaked into it), and
`latest` names only checkpoints whose write finished."""

from __future__ import annotations

import shutil

import pytest

from tests.support.harness import STEPS, launch, make_job

TOL = 1e-5


@pytest.fixture(scope="module")
def async_run(corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("async") / "fsdp2"
    job = make_job(
        run,
        corpus,
        steps=STEPS,
        train_kw={"checkpoint_every": 1, "async_checkpoint": True},
        dp_shard=2,
        micro_batch=2,
        grad_accum=2,
    )
    return run, launch(2, job, timeout=280)


def test_async_saves_leave_training_unchanged(async_run, reference):
    run, out = async_run
    assert "async checkpoint step 1" in out.output, out.output[-3000:]
    diff = max(abs(a - b) for a, b in zip(out.losses, reference.losses))
    assert len(out.losses) == STEPS and diff <= TOL, (out.losses, reference.losses)
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS}"
    for k in range(1, STEPS + 1):
        assert (run / "checkpoints" / f"step-{k}" / "meta.json").is_file(), k  # published once written
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("step", [2, 3])
def test_an_async_checkpoint_resumes_on_the_reference_curve(async_run, reference, corpus, tmp_path, step):
    run, _ = async_run
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / f"step-{step}", resumed / "checkpoints" / f"step-{step}")
    (resumed / "checkpoints" / "latest").write_text(f"step-{step}\n")
    job = make_job(resumed, corpus, steps=STEPS, job_kw={"attempt": 1}, micro_batch=2, grad_accum=4)
    out = launch(1, job, timeout=200)
    assert [m.step for m in out.metrics] == list(range(step + 1, STEPS + 1)), out.output[-3000:]
    diff = max(abs(a - b) for a, b in zip(out.losses, reference.losses[step:]))
    print(f"resumed from async step-{step}: max |loss - ref| = {diff:.2e}")
    assert diff <= TOL, (out.losses, reference.losses[step:])
