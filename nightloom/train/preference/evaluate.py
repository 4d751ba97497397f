"""`nightloom eval RUN --data pairs.jsonl` for a train.task dpo run: the run's latest checkpoint scored on preference
pairs (rendered as the shard stage renders them, nightloom/chat_pairs.py) against its reference: the DPO loss of
train.preference, the reward accuracy and margin, and TRL's other figures. One process, fp32.

The reference is the run's: with LoRA the checkpoint's model with its adapters disabled; with full fine-tuning the
initial weights (model.weights, or the seeded random start) rebuilt beside it; none for simpo and orpo."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nightloom.spec.preference import PreferenceSpec
from nightloom.train.preference.data import eval_pairs_file, pair_batch
from nightloom.train.preference.logps import sequence_logps
from nightloom.train.preference.losses import LossSettings, pair_loss
from nightloom.train.preference.metrics import PairSums
from nightloom.train.preference.reference import adapters_disabled

BATCH_PAIRS = 8


@dataclass(frozen=True)
class PairEval:
    """The figures of one `nightloom eval` of a dpo run (TRL's names in `figures`, `loss` the preference loss)."""

    figures: dict[str, float]
    pairs: int
    step: int
    checkpoint: str


def _initial_model(job, seq_len: int):
    """The run's starting weights on CPU: model.weights, or the seeded random start."""
    from nightloom.hf.load import fetch_weights, load_hf_weights
    from nightloom.train.model import build_model

    model = build_model(job.model, seq_len, device="cpu")
    model.init_weights(job.train.seed)
    if job.weights:
        load_hf_weights([model], fetch_weights(job.weights, job.s3, log=lambda _: None), job.model, log=lambda _: None)
    return model.eval()


@torch.no_grad()
def evaluate_pairs(run_dir: str | Path, data: str | Path, seq_len: int | None = None) -> PairEval:
    """Score the run's latest checkpoint on a JSONL file of preference pairs (see the module docstring)."""
    from nightloom.train.evaluate import EvalError, load_model, run_job

    job = run_job(Path(run_dir))
    n = seq_len or job.train.seq_len
    model, job, step, path = load_model(Path(run_dir), n + 1)
    pref = job.train.preference or PreferenceSpec()
    how = pref.reference_how(job.train.lora is not None)
    reference = _initial_model(job, n + 1) if how in ("precomputed", "frozen_copy") else None
    settings = LossSettings(pref.loss, pref.beta, pref.label_smoothing, pref.simpo_gamma)
    data = Path(data)
    if not data.is_file():
        raise EvalError(f"{data}: --data: file not found")
    chat = job.chat_settings(n).model_copy(update={"task": "dpo"})
    try:
        docs = eval_pairs_file(data, job.tokenizer.path or "", chat)
    except ValueError as e:
        raise EvalError(str(e)) from None
    if not docs:
        raise EvalError(f"{data}: no preference pair fits seq_len + 1 = {n + 1} ids")
    sums = PairSums()
    pad = int(docs[0][0][-1])  # any id: padding is never a label
    for i in range(0, len(docs), BATCH_PAIRS):
        b = pair_batch([(np.asarray(a), np.asarray(lab)) for a, lab in docs[i : i + BATCH_PAIRS]], pad)
        policy = sequence_logps(model(b.inputs), b.targets).halves()
        ref = None
        if how != "none":
            with adapters_disabled(model) if reference is None else nullcontext():
                r = sequence_logps((reference or model)(b.inputs), b.targets).halves()
            ref = (r[0].total, r[1].total)
        sums.add(pair_loss(policy, ref, settings), policy, pref.loss in ("simpo", "orpo"))
    return PairEval(sums.figures(), len(docs), step, str(path))
