"""DPO, nightloom against TRL's DPOTrainer: LoRA and full fine-tuning of the chat demo's tiny random Qwen2
(deployments/chat-sft-demo-model.json) on pref-demo's pairs, one process on CPU, measured in one run (ratios, not
absolute claims).

Both train on the same pairs in the same order: nightloom's pair shards are read back in its step order and the
records they came from are handed to TRL (which tokenizes them by the same prefix rule into the same ids), with
TRL's shuffling off. Same settings: sigmoid loss, beta 0.1, seq_len, micro-batch (pairs) and accumulation, AdamW,
fp32, grad clip 1.0, one thread; LoRA rank 8, alpha 16 on every linear, the reference the base with the adapters
disabled on both sides; full fine-tuning with the reference's log-probs computed once before training on both
sides (nightloom's `precomputed`, TRL's `precompute_ref_log_probs`), so neither holds a second model. Each side
runs in its own process, so its peak RSS (nightloom/peak_rss.py: the process's own since start) is its own. A
step's time is from its start to the next one's; the first `--warmup` steps and the last are left out. Label
tokens (completion tokens of chosen and rejected) are counted from the same pairs for both. Printed: label
tokens/s by wall and CPU time, peak RSS, then nightloom / TRL.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/dpo.py [--steps 30] [--seq-len 256] [--micro-batch 2]
       [--grad-accum 2] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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

import torch  # noqa: E402

LR, LORA_RANK, LORA_ALPHA, BETA, SEED = 1e-3, 8, 16, 0.1, 1234


def prepare(folder: Path, seq_len: int) -> None:
    """pref-demo's pairs, a ChatML BPE trained on them, the demo's random Qwen2 and nightloom's pair shards."""
    from nightloom.chat import ChatSettings, template_text
    from nightloom.hf.random_model import ensure_demo_weights
    from nightloom.sharding import shard_dataset
    from nightloom.sharding.corpus import ensure_sample_corpus
    from nightloom.spec import DatasetSpec, ShardingSpec, TokenizerSpec
    from nightloom.tokenizer import ensure_trained

    pairs = ensure_sample_corpus(folder / "pairs.jsonl", kind="pairs")
    dataset = DatasetSpec(path=str(pairs))
    ensure_trained(TokenizerSpec(path=str(folder / "tokenizer"), train_vocab=512), dataset, chat=True)
    ensure_demo_weights(folder / "qwen2", ROOT / "deployments" / "chat-sft-demo-model.json")
    chat = ChatSettings(template=template_text(folder / "tokenizer"), seq_len=seq_len, task="dpo")
    sharding = ShardingSpec(output=str(folder / "shards"), num_shards=1, tolerance=0.9)
    shard_dataset(dataset, sharding, tokenizer=TokenizerSpec(path=str(folder / "tokenizer")), chat=chat)


def ordered_pairs(folder: Path, seq_len: int, n: int) -> tuple[list[dict], list[int]]:
    """The records of nightloom's first `n` pairs in its step order, and each pair's label tokens."""
    from nightloom.chat import ChatRenderer, template_text
    from nightloom.chat_pairs import render_pair, to_pair
    from nightloom.spec import TokenizerSpec
    from nightloom.train.preference.data import PairRows

    tok = folder / "tokenizer"
    render = ChatRenderer(tok, template_text(tok), seq_len)
    by_ids = {}
    for line in (folder / "pairs.jsonl").read_text().splitlines():
        rec = json.loads(line)
        conv = render_pair(render, to_pair(rec))
        if conv is not None:
            by_ids[tuple(conv.ids)] = {k: rec[k] for k in ("prompt", "chosen", "rejected")}
    rows = PairRows(str(folder / "shards"), SEED, TokenizerSpec(path=str(tok)))
    docs = rows.docs(0, n)
    return [by_ids[tuple(int(i) for i in ids)] for ids, _ in docs], [int(labels[1:].sum()) for _, labels in docs]


def nightloom_side(folder: Path, args, lora: bool) -> list[tuple[float, float]]:
    """nightloom's Trainer in this process: the clocks at each step's start."""
    from nightloom.hf.config import shape_from_hf_config
    from nightloom.parallel import ParallelPlan
    from nightloom.spec import LoraSpec, TokenizerSpec, TrainSpec
    from nightloom.spec.preference import PreferenceSpec
    from nightloom.train.job import TrainJob
    from nightloom.train.trainer import Trainer, _init_distributed

    clocks: list[tuple[float, float]] = []

    class Timed(Trainer):
        def _forward_backward(self, step):
            clocks.append((time.perf_counter(), time.process_time()))
            return super()._forward_backward(step)

    train = TrainSpec(
        task="dpo",
        preference=PreferenceSpec(beta=BETA, reference="adapters_off" if lora else "precomputed"),
        steps=args.steps,
        seq_len=args.seq_len,
        global_batch=args.micro_batch * args.grad_accum,
        lr=LR,
        warmup_steps=0,
        weight_decay=0.0,
        export="none",
        seed=SEED,
        lora=LoraSpec(rank=LORA_RANK, alpha=LORA_ALPHA, targets="all-linear") if lora else None,
    )
    weights = folder / "qwen2"
    run_dir = folder / f"nightloom-{'lora' if lora else 'full'}"
    job = TrainJob(
        run_id=run_dir.name,
        run_dir=str(run_dir),
        model=shape_from_hf_config(weights / "config.json"),
        plan=ParallelPlan(micro_batch=args.micro_batch, grad_accum=args.grad_accum),
        train=train,
        manifest=str(folder / "shards"),
        peak_flops=1e11,
        peak_source="bench",
        weights=str(weights),
        tokenizer=TokenizerSpec(path=str(folder / "tokenizer")),
        resume=False,
    )
    Timed(job, _init_distributed(job)).run()
    return clocks


def trl_side(folder: Path, args, lora: bool, records: list[dict]) -> list[tuple[float, float]]:
    """TRL's DPOTrainer on the same pairs in the same order: the clocks at each step's start."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class Timer(TrainerCallback):
        def __init__(self):
            self.clocks: list[tuple[float, float]] = []

        def on_step_begin(self, *a, **k):
            self.clocks.append((time.perf_counter(), time.process_time()))

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(
            r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    config = DPOConfig(
        output_dir=str(folder / "trl-out"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=LR,
        weight_decay=0.0,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        warmup_steps=0,
        beta=BETA,
        max_length=args.seq_len + 1,
        precompute_ref_log_probs=not lora,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_steps=10_000,
        dataloader_num_workers=0,
        dataset_num_proc=None,
        disable_tqdm=True,
        seed=SEED,
    )
    timer = Timer()
    model = AutoModelForCausalLM.from_pretrained(folder / "qwen2", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder / "tokenizer")
    InOrder(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
        peft_config=peft,
        callbacks=[timer],
    ).train()
    return timer.clocks


def side(args) -> int:
    """One side in this process: prints {wall, cpu, labels, peak_rss} of its timed steps as JSON."""
    from nightloom.peak_rss import peak_rss_bytes

    torch.set_num_threads(1)
    folder, g = Path(args.folder), args.micro_batch * args.grad_accum
    records, labels = ordered_pairs(folder, args.seq_len, args.steps * g)
    lora = args.kind == "lora"
    clocks = nightloom_side(folder, args, lora) if args.side == "nightloom" else trl_side(folder, args, lora, records)
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(clocks, clocks[1:])][args.warmup :]
    kept = labels[args.warmup * g : (args.warmup + len(steps)) * g]
    out = {"wall": sum(s[0] for s in steps), "cpu": sum(s[1] for s in steps), "labels": sum(kept)}
    print("RESULT " + json.dumps({**out, "peak_rss": peak_rss_bytes()}), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--side", choices=("nightloom", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=("lora", "full"), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return side(args)
    results = {}
    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as tmp:
        prepare(Path(tmp), args.seq_len)
        common = [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(args).items()
            if k in ("steps", "seq_len", "micro_batch", "grad_accum", "warmup")
        ]
        for kind in ("lora", "full"):
            for who in ("nightloom", "trl"):
                cmd = [sys.executable, __file__, *common, f"--side={who}", f"--kind={kind}", f"--folder={tmp}"]
                p = subprocess.run(cmd, capture_output=True, text=True, check=False)
                line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"{who} {kind} failed:\n{(p.stdout + p.stderr)[-4000:]}")
                results[(who, kind)] = json.loads(line[len("RESULT ") :])
    print(
        f"tiny Qwen2 (chat-sft-demo-model.json), pref-demo's pairs, seq_len {args.seq_len}, {args.micro_batch} pairs "
        f"x {args.grad_accum} per step, steps {args.warmup + 1}-{args.steps - 1} of {args.steps} timed, 1 thread"
    )
    for (who, kind), r in results.items():
        print(
            f"{who:>9} {kind}: label tok/s {r['labels'] / r['wall']:>7,.0f} wall {r['labels'] / r['cpu']:>7,.0f} "
            f"CPU; peak RSS {r['peak_rss'] / 2**20:,.0f} MiB"
        )
    for kind in ("lora", "full"):
        n, t = results[("nightloom", kind)], results[("trl", kind)]
        print(
            f"nightloom / TRL, {kind}: label tokens/s {t['wall'] / n['wall']:.2f}x wall, {t['cpu'] / n['cpu']:.2f}x "
            f"CPU time; peak RSS {n['peak_rss'] / t['peak_rss']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
