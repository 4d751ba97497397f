"""DCP checkpoints: save in TP2xDP2, resume in PP2xDP2 and in 1 process; a tied model across PP, TP and one
process; stop/deadline then resume."""

from __future__ import annotations

import shutil
import time

import pytest

from tests.support.harness import REF_PLAN, STEPS, launch, launch_many, make_job, result

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


def _stored_keys(run, step: int) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(run / "checkpoints" / f"step-{step}")).read_metadata().state_dict_metadata)


@pytest.mark.timeout(400)
def test_tied_model_is_stored_once_and_resumes_across_layouts(corpus, tmp_path):
    """`tiny-tied` (embedding and head one matrix): checkpointed under PP2 (first and last stage each hold a copy)
    it resumes in one process and under TP2; checkpointed in one process it resumes under PP2 (the last stage reads
    its head from the stored embedding). Both checkpoints hold the matrix and its optimizer state once."""
    tied = {"model": "tiny-tied", "steps": STEPS, "train_kw": {"checkpoint_every": 3}}
    one = tmp_path / "one"
    reference = launch(1, make_job(one, corpus, **tied, **REF_PLAN))
    assert len(reference.losses) == STEPS, reference.output[-3000:]
    pp = tmp_path / "pp2"
    out = launch(2, make_job(pp, corpus, **tied, pp=2, micro_batch=2, grad_accum=4), timeout=280)
    diff = max(abs(a - b) for a, b in zip(out.losses, reference.losses))
    print(f"tied pp2: max |loss - ref| = {diff:.2e}")
    assert len(out.losses) == STEPS and diff <= TOL, (out.losses, reference.losses)
    for run in (one, pp):
        keys = _stored_keys(run, 3)
        assert "model.tok_embeddings.weight" in keys and "optim.state.tok_embeddings.weight.exp_avg" in keys
        assert not [k for k in keys if "output.weight" in k], sorted(k for k in keys if "output" in k)

    resumed = {"attempt": 1}
    one_from_pp = tmp_path / "pp2_to_one"
    _copy_checkpoint(pp, one_from_pp, 3)
    job = make_job(one_from_pp, corpus, model="tiny-tied", steps=STEPS, job_kw=resumed, micro_batch=8, grad_accum=1)
    _check_resumed(launch(1, job), reference, 4)

    tp_from_pp, pp_from_one = tmp_path / "pp2_to_tp2", tmp_path / "one_to_pp2"
    _copy_checkpoint(pp, tp_from_pp, 3)
    _copy_checkpoint(one, pp_from_one, 3)
    jobs = [
        make_job(tp_from_pp, corpus, model="tiny-tied", steps=STEPS, job_kw=resumed, tp=2, sp=True, **REF_PLAN),
        make_job(pp_from_one, corpus, model="tiny-tied", steps=STEPS, job_kw=resumed, pp=2, **REF_PLAN),
    ]
    for job, run in launch_many(2, jobs, timeout=280).items():
        print(job.parent.name, end=": ")
        _check_resumed(run, reference, 4)


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


@pytest.mark.timeout(900)  # three tries at worst (each its deadline + start-up)
def test_deadline_mid_run_checkpoints_and_stops_in_time(corpus, tmp_path):
    """A window ending while training: all ranks agree to stop, checkpoint the last step, exit 0. The deadline must
    fall after step 1: on a loaded machine two ranks' start-up can outlast 20 s (then nothing trains: the case of
    the test above), so a run that stopped before its first step is tried again with a later deadline."""
    for margin_s in (20, 60, 180):
        deadline = time.time() + margin_s
        job = make_job(
            tmp_path / f"window-{margin_s}",
            corpus,
            steps=1_000_000,
            job_kw={"deadline_unix": deadline},
            dp_shard=2,
            micro_batch=2,
            grad_accum=2,
        )
        out = launch(2, job, timeout=margin_s + 150)
        r = result(job)
        if r["steps_done"] > 0:
            break
        print(f"start-up outlasted a deadline {margin_s} s away: again with a later one")
    ended = out.metrics[-1].time if out.metrics else deadline
    print(f"stopped at step {r['steps_done']}, last step ended {ended - deadline:+.2f} s from the deadline")
    assert r["stopped"] == "deadline" and r["steps_done"] == len(out.metrics) > 0, out.output[-3000:]
    assert r["last_checkpoint"].endswith(f"step-{r['steps_done']}")
    assert ended <= deadline + 2 * out.metrics[-1].step_time_s + 1.0  # stopped at the window's end, not later
