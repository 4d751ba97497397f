"""Unpacked SFT, nightloom against TRL's SFTTrainer: LoRA and full fine-tuning of the chat demo's tiny random Qwen2
(deployments/chat-sft-demo-model.json) on the demo's chats, one process on CPU, measured in one run (ratios, not
absolute claims).

Both train on the same conversations in the same order: nightloom's chat shards (the trainer's own ids and
assistant labels, one conversation per row) are read back in nightloom's step order and handed to TRL pre-tokenized
(`input_ids`, `labels` -100 where no label), with TRL's shuffling off, so every step has the same rows on both
sides. Same settings: seq_len, micro-batch and accumulation, AdamW, fp32, grad clip 1.0, one thread; LoRA rank 8,
alpha 16 on every linear. nightloom runs its real Trainer in this process (a one-rank group), TRL its
SFTTrainer, whose collator pads each micro-batch to its longest row. A step's time is from its start to the next
one's (nightloom: each call of the trainer's step; TRL: each on_step_begin), so each side's whole loop counts; the
first `--warmup` steps and the last are left out on both. Two clocks: wall time, and the process's CPU time (one
thread each: on a shared, loaded machine wall time mostly measures the neighbours, CPU time the work). Printed per
side: label tokens/s (what training is for: the same labels both ways), ids computed per second and the share of
computed ids that are conversation tokens; then nightloom / TRL per clock. Runs interleave, medians compared.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/sft_vs_trl.py [--steps 40] [--seq-len 512] [--micro-batch 4]
       [--grad-accum 2] [--repeats 2] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402

LR, LORA_RANK, LORA_ALPHA = 1e-3, 8, 16


def prepare(folder: Path, seq_len: int):
    """The demo's chats, its trained BPE (ChatML), its random Qwen2 and nightloom's chat shards of them:
    (shards, tokenizer folder, weights folder)."""
    from nightloom.chat import ChatSettings, template_text
    from nightloom.hf.random_model import ensure_demo_weights
    from nightloom.sharding import shard_dataset
    from nightloom.sharding.corpus import ensure_sample_corpus
    from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
    from nightloom.tokenizer import ensure_trained

    chats = ensure_sample_corpus(folder / "chats.jsonl", kind="chats")
    dataset = DatasetSpec(path=str(chats))
    tok = folder / "tokenizer"
    ensure_trained(TokenizerSpec(path=str(tok), train_vocab=512), dataset, chat=True)
    weights = ensure_demo_weights(folder / "qwen2", ROOT / "deployments" / "chat-sft-demo-model.json")
    shard_dataset(
        dataset,
        ShardingSpec(output=str(folder / "shards"), num_shards=1, tolerance=0.9),
        tokenizer=TokenizerSpec(path=str(tok)),
        chat=ChatSettings(template=template_text(tok), seq_len=seq_len),
    )
    return folder / "shards", tok, weights


def trl_rows(shards: Path, tok: Path, seq_len: int, seed: int, n: int) -> list[dict]:
    """The first `n` rows of nightloom's row stream (its seeded order) as TRL's pre-tokenized records."""
    from nightloom.spec import TokenizerSpec
    from nightloom.train.data import ConversationRows

    rows = ConversationRows(str(shards), seq_len, seed=seed, tokenizer=TokenizerSpec(path=str(tok)))
    ids, labels, lengths = rows.rows_at(np.arange(n))
    out = []
    for a, b, k in zip(ids, labels, lengths):
        a, b = a[:k].tolist(), b[:k].tolist()
        out.append({"input_ids": a, "labels": [t if m else -100 for t, m in zip(a, b)]})
    return out


def nightloom_run(run_dir: Path, shards: Path, tok: Path, weights: Path, args, lora: bool, group: bool = False):
    """nightloom's Trainer in this process; (step times, label tokens, computed ids) per step."""
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import LoraSpec, TokenizerSpec, TrainSpec
    from nightloom.train.job import TrainJob
    from nightloom.train.trainer import Trainer, _init_distributed

    class Timed(Trainer):
        def _forward_backward(self, step):
            clocks.append((time.perf_counter(), time.process_time()))
            return super()._forward_backward(step)

    train = TrainSpec(
        task="sft",
        steps=args.steps,
        seq_len=args.seq_len,
        global_batch=args.micro_batch * args.grad_accum,
        lr=LR,
        warmup_steps=0,
        weight_decay=0.0,
        export="none",
        group_by_length=group,
        lora=LoraSpec(rank=LORA_RANK, alpha=LORA_ALPHA, targets="all-linear") if lora else None,
    )
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=shape_from_hf_config(weights / "config.json"),
        plan=ParallelPlan(micro_batch=args.micro_batch, grad_accum=args.grad_accum),
        train=train,
        manifest=str(shards),
        peak_flops=1e11,
        peak_source="bench",
        weights=str(weights),
        tokenizer=TokenizerSpec(path=str(tok)),
        resume=False,
    )
    clocks: list[tuple[float, float]] = []
    Timed(job, _init_distributed(job)).run()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return _steps(clocks, [(m["label_tokens"], m["tokens"]) for m in steps])


def _steps(clocks, counts):
    """(wall s, CPU s, label tokens, computed ids) of each step but the last, from the clocks at each step's start."""
    return [(b[0] - a[0], b[1] - a[1], *c) for a, b, c in zip(clocks, clocks[1:], counts)]


def trl_run(out: Path, records: list[dict], tok: Path, weights: Path, args, lora: bool):
    """TRL's SFTTrainer on the same rows in the same order; (step time, label tokens, computed ids) per step."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class Timer(TrainerCallback):
        def __init__(self):
            self.clocks: list[tuple[float, float]] = []

        def on_step_begin(self, *a, **k):
            self.clocks.append((time.perf_counter(), time.process_time()))

    class InOrder(SFTTrainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(
            r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    config = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=LR,
        weight_decay=0.0,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        warmup_steps=0,
        max_length=args.seq_len + 1,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=10_000,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=1234,
    )
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    timer = Timer()
    trainer = InOrder(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(tok),
        peft_config=peft,
        callbacks=[timer],
    )
    trainer.train()
    g, counts = args.micro_batch * args.grad_accum, []
    for s in range(args.steps):
        step_rows = records[s * g : (s + 1) * g]
        labels = sum(sum(t != -100 for t in r["labels"][1:]) for r in step_rows)
        computed = sum(
            len(step_rows[i : i + args.micro_batch])
            * max(len(r["input_ids"]) for r in step_rows[i : i + args.micro_batch])
            for i in range(0, g, args.micro_batch)
        )
        counts.append((labels, computed))
    return _steps(timer.clocks, counts)


def rates(steps, warmup: int) -> tuple[float, float, float, float, int, int]:
    """(label tokens/s, computed ids/s by wall time, the same by CPU time, label tokens, computed ids) over the
    steps after `warmup`."""
    kept = steps[warmup:]
    wall, cpu = sum(s[0] for s in kept), sum(s[1] for s in kept)
    labels, computed = sum(s[2] for s in kept), sum(s[3] for s in kept)
    return labels / wall, computed / wall, labels / cpu, computed / cpu, labels, computed


def report(runs: dict, names: tuple[str, ...], kept: list[dict], args) -> None:
    """Per configuration the medians over repeats; the ratios nightloom / TRL per clock."""
    print(
        f"tiny Qwen2 (chat-sft-demo-model.json), seq_len {args.seq_len}, micro-batch {args.micro_batch} x "
        f"{args.grad_accum}, steps {args.warmup + 1}-{args.steps - 1} of {args.steps} timed, median of "
        f"{args.repeats}, 1 thread"
    )
    med = {n: [statistics.median(r[i] for r in rs) for i in range(6)] for n, rs in runs.items()}
    conv = sum(len(r["input_ids"]) for r in kept)
    print(f"conversation tokens / ids computed if padded to seq_len: {conv / (len(kept) * args.seq_len):.1%}")
    for name in names:
        wall, ids_wall, cpu, ids_cpu, _, computed = med[name]
        print(
            f"{name:>22}: label tok/s {wall:>7,.0f} wall {cpu:>7,.0f} CPU; ids/s {ids_wall:>7,.0f} wall "
            f"{ids_cpu:>7,.0f} CPU; conversation tokens {conv / computed:.1%} of ids computed"
        )
    for kind in ("lora", "full"):
        n, t = med[f"nightloom {kind}"], med[f"trl {kind}"]
        print(f"label tokens/s, nightloom / TRL, {kind}: {n[0] / t[0]:.2f}x wall, {n[2] / t[2]:.2f}x CPU time")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = args.micro_batch * args.grad_accum
    names = ("nightloom lora", "trl lora", "nightloom full", "trl full", "nightloom full grouped")
    runs: dict[str, list[tuple]] = {}
    with tempfile.TemporaryDirectory(prefix="sft-vs-trl-") as tmp:
        folder = Path(tmp)
        shards, tok, weights = prepare(folder, args.seq_len)
        records = trl_rows(shards, tok, args.seq_len, 1234, args.steps * g)
        for rep in range(args.repeats):
            for name in names:
                run, lora = folder / f"{name.replace(' ', '-')}-{rep}", "lora" in name
                if name.startswith("trl"):
                    steps = trl_run(run, records, tok, weights, args, lora)
                else:
                    steps = nightloom_run(run, shards, tok, weights, args, lora, group="grouped" in name)
                runs.setdefault(name, []).append(rates(steps, args.warmup))
    report(runs, names, records[args.warmup * g : (args.steps - 1) * g], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
