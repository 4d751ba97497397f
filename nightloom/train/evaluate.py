"""Score a run's latest checkpoint on documents (`nightloom eval`): mean NLL per predicted token and perplexity.

Per document: the run's tokenizer ids (its own rules, no EOS appended), the first `seq_len` of them; every
next-token prediction inside that prefix counts (a document of n ids predicts n-1 tokens). loss = the sum of
those NLLs over all documents / their number, ppl = exp(loss). A run of train.task sft scores chat records by its
own rule: each conversation rendered with the run's chat template and cut (or dropped) at seq_len + 1 ids as the
shard stage does (nightloom/chat.py), only its assistant tokens (labels by the prefix rule) predicted and counted. One process, fp32, the model rebuilt from the
run's job file and filled from the DCP checkpoint (DCP reshards whatever layout saved it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


class EvalError(ValueError):
    """A run folder, checkpoint or data file that cannot be scored; the message names it."""


@dataclass(frozen=True)
class EvalResult:
    loss: float
    tokens: int  # predicted tokens
    ppl: float
    documents: int
    step: int
    checkpoint: str
    task: str = "pretrain"  # sft: `tokens` are the conversations' assistant tokens
    dropped: int = 0  # sft: conversations with no run of whole turns that fits seq_len + 1 ids (not scored)


def run_job(run_dir: Path):
    """The run's TrainJob: the newest job*.json in the run folder (the pipeline writes one per attempt)."""
    from nightloom.train.job import TrainJob

    jobs = sorted(run_dir.glob("job*.json"), key=lambda p: p.stat().st_mtime)
    if not jobs:
        raise EvalError(f"{run_dir}: no job*.json (not a nightloom run folder?)")
    return TrainJob.model_validate_json(jobs[-1].read_text(encoding="utf-8"))


def load_model(run_dir: Path, seq_len: int):
    """(model, step, checkpoint path) from the run's latest checkpoint, on CPU in fp32, in eval mode."""
    from nightloom.train import checkpoint
    from nightloom.train.lora import LoraSettings, apply_lora
    from nightloom.train.model import build_model

    job = run_job(run_dir)
    found = checkpoint.latest(job.checkpoint_dir)
    if found is None:
        raise EvalError(f"{job.checkpoint_dir}: no checkpoint (did the run save one?)")
    path, step = found
    lora = LoraSettings.from_spec(job.train.lora)
    if lora is not None and (lora.quant is not None or checkpoint.read_meta(path).get("adapters_only")):
        model = lora_model(job, lora, seq_len)  # the base from model.weights (quantized as trained), then adapters
    else:
        model = build_model(job.model, seq_len, device="cpu")
        if lora is not None:  # the checkpoint holds the frozen base and the adapters: score base + adapter
            apply_lora(model, lora)
    checkpoint.load_weights(path, model)  # a tied matrix is stored once
    model.eval()
    return model, job, step, path


def lora_model(job, lora, seq_len: int):
    """A LoRA run's model on CPU with its base as the run trained on it: model.weights (or the seeded random start),
    quantized with train.lora.quantize; the adapters are left for the checkpoint to fill."""
    from nightloom.hf.load import fetch_weights, load_hf_weights
    from nightloom.train.lora import apply_lora
    from nightloom.train.model import build_model
    from nightloom.train.qlora import init_quantized, quantize_base

    model = build_model(job.model, seq_len, device="meta")
    if lora.quant is not None:
        quantize_base(model, lora.quant)
    apply_lora(model, lora)
    model.to_empty(device="cpu")
    model.init_weights(job.train.seed)
    if lora.quant is not None:
        init_quantized(model, job.train.seed)
    if job.weights:
        load_hf_weights([model], fetch_weights(job.weights, job.s3, log=lambda _: None), job.model, log=lambda _: None)
    return model


def read_documents(path: Path, text_field: str = "text") -> list[str]:
    from nightloom.sharding.sources import read_records

    if not path.is_file():
        raise EvalError(f"{path}: --data: file not found")
    docs = []
    for where, text, _, err, _ in read_records(path, "jsonl", text_field, None):
        if err is not None:
            raise EvalError(f"{path}:{where}: {err}")
        docs.append(text or "")
    return docs


@torch.no_grad()
def score(model, ids_per_doc: list[list[int]], seq_len: int) -> tuple[float, int]:
    """(sum of NLL, predicted tokens) over documents, each cut to its first `seq_len` ids."""
    total, count = 0.0, 0
    for ids in ids_per_doc:
        ids = ids[:seq_len]
        if len(ids) < 2:
            continue
        x = torch.tensor([ids], dtype=torch.long)
        logits = model(x[:, :-1]).float()
        total += float(F.cross_entropy(logits[0], x[0, 1:], reduction="sum").double())
        count += len(ids) - 1
    return total, count


@torch.no_grad()
def score_labels(model, conversations) -> tuple[float, int]:
    """(sum of NLL, predicted tokens) over conversations' label tokens (nightloom.chat.Conversation)."""
    total, count = 0.0, 0
    for c in conversations:
        ids = torch.tensor([c.ids], dtype=torch.long)
        mask = torch.tensor(c.labels[1:], dtype=torch.bool)
        logits = model(ids[:, :-1]).float()[0]
        total += float(F.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum").double())
        count += int(mask.sum())
    return total, count


def _conversations(job, data: Path, tok, n: int):
    """(conversations, dropped) of a JSONL file of chat records, rendered as the run's shard stage did."""
    from nightloom.chat import ChatError
    from nightloom.sharding.scan_chats import render_chat_file

    if not data.is_file():
        raise EvalError(f"{data}: --data: file not found")
    try:
        return render_chat_file(data, getattr(tok, "folder", ""), job.chat_settings(n))
    except ChatError as e:
        raise EvalError(str(e)) from None


def evaluate_run(run_dir: str | Path, data: str | Path, seq_len: int | None = None) -> EvalResult:
    """Score the run's latest checkpoint on a JSONL file's documents (see the module docstring)."""
    from nightloom.tokenizer import load_tokenizer

    run_dir = Path(run_dir)
    job = run_job(run_dir)
    n = seq_len or job.train.seq_len
    if n > job.model.max_seq:
        raise EvalError(f"--seq-len {n} exceeds the model's max_seq {job.model.max_seq}")
    sft = job.train.task == "sft"
    tok = load_tokenizer(job.tokenizer)
    docs = _conversations(job, Path(data), tok, n) if sft else read_documents(Path(data))
    if tok.vocab_size > job.model.vocab:
        raise EvalError(f"tokenizer has {tok.vocab_size} ids but the run's model has {job.model.vocab} rows")
    model, _, step, path = load_model(run_dir, n)
    if sft:
        (convs, dropped), where = docs, str(path)
        total, count = score_labels(model, convs)
        if count == 0:
            raise EvalError(f"{data}: no assistant token to score ({dropped} conversations longer than {n + 1} ids)")
        loss = total / count
        return EvalResult(loss, count, math.exp(min(loss, 700.0)), len(convs), step, where, "sft", dropped)
    total, count = score(model, tok.encode_batch(docs), n)
    if count == 0:
        raise EvalError(f"{data}: no document has two tokens: nothing to predict")
    loss = total / count
    return EvalResult(loss, count, math.exp(min(loss, 700.0)), len(docs), step, str(path))
