"""DCP checkpoints: save in TP2xDP2, resume in PP2xDP2 and in 1 process; stop/deadline then resume."""

from __future__ import annotations

import shutil
import time

import pytest

from tests.support.harness import STEPS, launch, make_job, result

TOL = 1e-5


def _copy_checkpoint(src_run, dst_run, step: int) -> None:
    dst = dst_run / "checkpoints"
    dst.mkdir(parents=True)
    shutil.copytree(src_run / "checkpoints" / f"step-{step}", dst / f"step-{step}")
    (dst / "latest").write_text(f"step-{step}\n")


def _check_resumed(out, reference, first_step: int) -> None:
    assert [m.step for m in out.metrics] == list(range(first_step, STEPS + 1)), out.output[-3000:]
    assert out.metrics[0].gap and not any(m.gap for m in out.metrics[1:])
    diff = max(abs(a - b) for a, b in zip(out.losses, reference.losses[first_step - 1 :]))
    print(f"resumed at step {first_step}: max |loss - ref| = {diff:.2e}")
    assert diff <= TOL, (out.losses, reference.losses)


@pytest.mark.timeout(400)
def test_save_tp2_dp2_resume_pp2_dp2_and_one_process(corpus, reference, tmp_path):
    saved = tmp_path / "tp2dp2"
    job = make_job(
        saved,
        corpus,
        steps=STEPS,
        train_kw={"checkpoint_every": 3},
        tp=2,
        sp=True,
        dp_shard=2,
        micro_batch=2,
        grad_accum=2,
    )
    out = launch(4, job, timeout=280)
    diff = max(abs(a - b) for a, b in zip(out.losses, reference.losses))
    print(f"tp2_dp2_sp: max |loss - ref| = {diff:.2e}")
    assert len(out.losses) == STEPS and diff <= TOL, (out.losses, reference.losses)
    assert (saved / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS}"
    assert result(job)["stopped"] == "completed"

    pp_run = tmp_path / "resume_pp2dp2"
    _copy_checkpoint(saved, pp_run, 3)
    job = make_job(
        pp_run,
        corpus,
        steps=STEPS,
        job_kw={"attempt": 1},
        pp=2,
        dp_shard=2,
        schedule="1f1b",
        micro_batch=2,
        grad_accum=2,
    )
    _check_resumed(launch(4, job, timeout=280), reference, 4)

    one = tmp_path / "resume_1p"
    _copy_checkpoint(saved, one, 3)
    job = make_job(one, corpus, steps=STEPS, job_kw={"attempt": 1}, micro_batch=8, grad_accum=1)
    _check_resumed(launch(1, job), reference, 4)


@pytest.mark.timeout(200)
def test_stop_after_steps_then_resume_continues_the_curve(corpus, reference, tmp_path):
    run = tmp_path / "stop"
    job = make_job(run, corpus, steps=STEPS, job_kw={"stop_after_steps": 2}, micro_batch=2, grad_accum=4)
    out = launch(1, job)
    r = result(job)
    assert (r["stopped"], r["steps_done"], r["total_steps"]) == ("stop_after_steps", 2, STEPS)
    assert r["last_checkpoint"].endswith("step-2")
    assert out.losses == pytest.approx(reference.losses[:2], abs=TOL)
    job = make_job(run, corpus, steps=STEPS, job_kw={"attempt": 1}, micro_batch=2, grad_accum=4)
    out = launch(1, job)
    resumed = [m for m in out.metrics if m.attempt == 1]
    assert [m.step for m in resumed] == [3, 4, 5] and resumed[0].gap
    assert [m.loss for m in resumed] == pytest.approx(reference.losses[2:], abs=TOL)
    assert result(job)["stopped"] == "completed"


@pytest.mark.timeout(120)
def test_deadline_in_the_past_stops_before_training(corpus, tmp_path):
    job = make_job(
        tmp_path / "late", corpus, steps=STEPS, job_kw={"deadline_unix": time.time() - 1}, micro_batch=2, grad_accum=4
    )
    out = launch(1, job)
    r = result(job)
    assert (r["stopped"], r["steps_done"]) == ("deadline", 0) and out.losses == []


@pytest.mark.timeout(200)
def test_deadline_mid_run_checkpoints_and_stops_in_time(corpus, tmp_path):
    """A window ending while training: all ranks agree to stop, checkpoint the last step, exit 0."""
    deadline = time.time() + 20
    job = make_job(
        tmp_path / "window",
        corpus,
        steps=1_000_000,
        job_kw={"deadline_unix": deadline},
        dp_shard=2,
        micro_batch=2,
        grad_accum=2,
    )
    out = launch(2, job, timeout=150)
    r = result(job)
    ended = out.metrics[-1].time if out.metrics else deadline
    print(f"stopped at step {r['steps_done']}, last step ended {ended - deadline:+.2f} s from the deadline")
    assert r["stopped"] == "deadline" and r["steps_done"] == len(out.metrics) > 0, out.output[-3000:]
    assert r["last_checkpoint"].endswith(f"step-{r['steps_done']}")
    assert ended <= deadline + 2 * out.metrics[-1].step_time_s + 1.0  # stopped at the window's end, not later
