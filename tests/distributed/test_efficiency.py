"""train.compile and the chunked loss on real ranks (CPU, gloo).

- torch.compile per block gives eager's loss curve within 1e-4 over 6 steps: one process (also with LoRA's forward
  hooks on the compiled blocks' linears), FSDP2 over 2 ranks, and on 2 ranks TP2, TP2 with SP (TP's hooks traced
  inside the blocks; the first block's input is the embedding's async collective output) and PP2 (1F1B).
- The cross-entropy fused with the head in chunks (train.loss_chunk_tokens, uneven chunks here) gives the plain
  loss's curve (loss_chunk_tokens 0: whole logits) within 1e-6 under FSDP2 2 ranks, grad norms too.

Every job of a world size runs in one launch (torchrun start-up and torch.compile's first compile dominate)."""

from __future__ import annotations

import pytest

from tests.support.harness import launch_many, make_job, write_corpus

STEPS = 6
COMPILE_TOL = 1e-4
CHUNK_TOL = 1e-6
CHUNK = 24  # tokens per chunk: 64 tokens per micro-batch -> chunks of 24, 24, 16
LORA = {"lora": {"rank": 4, "alpha": 8}, "lr": 1e-2}
_MODES = {"eager": {}, "compiled": {"compile": True}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("eff-corpus"))


def _jobs(root, corpus, cases):
    return {
        name: make_job(root / name, corpus, steps=STEPS, train_kw=train, **plan)
        for name, (plan, train) in cases.items()
    }


def _close(a, b, tol):
    assert len(a) == len(b) == STEPS, (a, b)
    return max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_compile_one_process(tmp_path, corpus):
    one = {"micro_batch": 2, "grad_accum": 4}
    jobs = _jobs(
        tmp_path,
        corpus,
        {
            "eager": (one, {}),
            "compiled": (one, {"compile": True}),
            "lora_eager": (one, LORA),
            "lora_compiled": (one, {**LORA, "compile": True}),
        },
    )
    runs = launch_many(1, list(jobs.values()), timeout=900)
    out = {k: runs[j] for k, j in jobs.items()}
    assert all(r.rc == 0 for r in out.values()), out["eager"].output[-4000:]
    eager, comp = out["eager"].losses, out["compiled"].losses
    print(f"compile 1 proc: eager {eager}\ncompiled {comp}")
    assert _close(eager, comp, COMPILE_TOL), (eager, comp)
    le, lc = out["lora_eager"].losses, out["lora_compiled"].losses
    assert _close(le, lc, COMPILE_TOL), (le, lc)
    assert le[-1] < le[0] and abs(le[0] - eager[0]) < 1e-6  # adapters train; B = 0 starts at the base model
    gn = [m.grad_norm for m in out["eager"].metrics], [m.grad_norm for m in out["compiled"].metrics]
    assert all(abs(a - b) <= 1e-3 * a for a, b in zip(*gn)), gn


def test_fsdp2_compile_and_chunked_loss(tmp_path, corpus):
    fsdp = {"dp_shard": 2, "micro_batch": 2, "grad_accum": 2}
    jobs = _jobs(
        tmp_path,
        corpus,
        {
            "plain": (fsdp, {"loss_chunk_tokens": 0}),
            "chunked": (fsdp, {"loss_chunk_tokens": CHUNK}),
            "compiled": (fsdp, {"loss_chunk_tokens": CHUNK, "compile": True}),
        },
    )
    runs = launch_many(2, list(jobs.values()), timeout=900)
    out = {k: runs[j] for k, j in jobs.items()}
    assert all(r.rc == 0 for r in out.values()), out["plain"].output[-4000:]
    plain, chunked, comp = (out[k].losses for k in ("plain", "chunked", "compiled"))
    print(f"fsdp2: plain {plain}\nchunked {chunked}\ncompiled {comp}")
    assert _close(plain, chunked, CHUNK_TOL), (plain, chunked)
    gp, gc = ([m.grad_norm for m in out[k].metrics] for k in ("plain", "chunked"))
    assert all(abs(a - b) <= 1e-5 * a for a, b in zip(gp, gc)), (gp, gc)
    assert _close(chunked, comp, COMPILE_TOL), (chunked, comp)


def test_tp_and_pp_compile(tmp_path, corpus):
    acc = {"micro_batch": 2, "grad_accum": 4}
    layouts = {"tp2": {"tp": 2, **acc}, "tp2_sp": {"tp": 2, "sp": True, **acc}, "pp2": {"pp": 2, **acc}}
    cases = {f"{name}_{mode}": (plan, train) for name, plan in layouts.items() for mode, train in _MODES.items()}
    jobs = _jobs(tmp_path, corpus, cases)
    runs = launch_many(2, list(jobs.values()), timeout=1800)
    out = {k: runs[j] for k, j in jobs.items()}
    assert all(r.rc == 0 for r in out.values()), out["tp2_eager"].output[-4000:]
    for name in layouts:
        eager, comp = out[f"{name}_eager"].losses, out[f"{name}_compiled"].losses
        print(f"{name}: eager {eager}\ncompiled {comp}")
        assert _close(eager, comp, COMPILE_TOL), (name, eager, comp)
        ge, gc = ([m.grad_norm for m in out[f"{name}_{mode}"].metrics] for mode in _MODES)
        assert all(abs(a - b) <= 1e-3 * a for a, b in zip(ge, gc)), (name, ge, gc)  # the embedding's gradient included
