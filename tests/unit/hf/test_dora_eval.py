"""A DoRA adapter exported by nightloom (train.lora.use_dora) scores in lm-eval as nightloom's own model scores in
process: on a local multiple-choice task, lm-eval's HF backend with the adapter loaded by PEFT (`peft=` onto the
base) gives every choice's log-likelihood within 1e-4 of the native DoRA model's (lm-eval's own encoding: the
context's ids, then the continuation's as encode(context + continuation) minus encode(context)), hence the same
acc; and nightloom's benchmark harness on the merged export gives that acc too. A tiny Qwen2 (q/k/v biases) with
its tokenizer, in process, a few seconds past lm-eval's import."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from nightloom.hf.export import ADAPTER_DIR, export_checkpoint
from nightloom.hf.load import model_from_hf
from nightloom.train.lora import LoraSettings, apply_lora
from tests.support.benchmarks import MC_TASK, qa_pairs, tiny_model, write_tasks
from tests.support.tiny_llama import MODULES

DORA = LoraSettings(8, 16.0, 0.0, MODULES, dora=True)
N = 12  # questions, 4 choices each


@pytest.fixture
def exported(tmp_path):
    """(native DoRA model with moved adapters and magnitudes, its export folder, the base folder)."""
    base = tiny_model(tmp_path / "base")
    model = model_from_hf(base, 256)
    apply_lora(model, DORA)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_magnitude_delta" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.eval()
    ckpt = tmp_path / "ckpt" / "step-1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(ckpt), no_dist=True)
    out = export_checkpoint(
        ckpt, model.shape, tmp_path / "export", "fp32", source_config=base, tokenizer=base, lora=DORA, base=str(base)
    )
    return model, out, base


def _native_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """lm-eval's HF loglikelihood of `continuation` after `context` (its _encode_pair: trailing spaces of the
    context move to the continuation; no special tokens), computed with nightloom's model."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    cont = whole[len(ctx) :]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:, :-1]).double(), dim=-1)[0]
    return float(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


@pytest.mark.slow
def test_an_exported_dora_adapter_scores_in_lm_eval_as_the_native_model(exported, tmp_path, monkeypatch):
    import lm_eval
    import transformers
    from lm_eval.tasks import TaskManager

    from nightloom.benchmarks.harness import OFFLINE, evaluate
    from nightloom.benchmarks.records import BenchJob

    model, out, base = exported
    folder = write_tasks(tmp_path / "tasks", qa_pairs(N))
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(folder)  # lm-eval reads relative data_files from the current folder
    adapter = str(out / ADAPTER_DIR)
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(base), "peft": adapter, "device": "cpu", "dtype": "float32"},
        tasks=[MC_TASK],
        batch_size=8,
        log_samples=True,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
    )
    samples = res["samples"][MC_TASK]
    assert len(samples) == N
    tok = transformers.AutoTokenizer.from_pretrained(base)
    hits, worst, moved = 0, 0.0, 0.0
    for s in samples:  # each request's args: (context, continuation); resps: [(loglikelihood, is_greedy)]
        theirs = [float(r[0][0]) for r in s["resps"]]
        ours = [_native_loglikelihood(model, tok, *args) for args in s["arguments"]]
        worst = max(worst, max(abs(a - b) for a, b in zip(ours, theirs, strict=True)))
        hits += int(max(range(len(ours)), key=ours.__getitem__) == int(s["target"]))
        moved = max(moved, abs(theirs[0] - _base_loglikelihood(base, tok, *s["arguments"][0])))
    assert worst < 1e-4, worst
    assert moved > 1e-2  # the adapter changed the scores: a base-only load would fail the comparison
    acc = res["results"][MC_TASK]["acc,none"]
    assert acc == pytest.approx(hits / N, abs=1e-9)

    job = BenchJob(models=[str(out)], tasks=[MC_TASK], include_path=str(folder), backend="hf", output="unused.json")
    merged = {(s.task, s.metric): s.value for s in evaluate(str(out), job)}
    assert merged[(MC_TASK, "acc")] == pytest.approx(acc, abs=1e-9)


_BASES: dict = {}


def _base_loglikelihood(base, tok, context: str, continuation: str) -> float:
    """The same log-likelihood under the base model alone (transformers), to show the adapter moved it."""
    if str(base) not in _BASES:
        import transformers

        _BASES.clear()
        _BASES[str(base)] = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    hf = _BASES[str(base)]
    return _native_loglikelihood(lambda ids: hf(ids).logits, tok, context, continuation)
