"""Native generation against transformers' `generate`, and one GRPO step's split, one process on CPU, in one run.

One random Llama (transformers, fp32) is loaded twice: as transformers' model and as nightloom's native model
(nightloom.hf.load.model_from_hf). Both generate the same batch of prompts (different lengths, so left padding)
greedily for exactly --new tokens (no EOS), interleaved repeats, medians; the tokens must agree (they are the
same model), and the figure is generated tokens/s, native over transformers (target >= 1.0x).

Then one GRPO step on the native model, each part timed: generation (--group completions of each prompt,
sampled), scoring (a built-in format reward and the DAPO length term), training (the policy's log-probs through
the training forward, the dapo loss, backward, an AdamW step).

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/rollout.py [--hidden 256] [--layers 4] [--batch 8] [--new 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch


def _prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (8 + (7 * i) % 25,), generator=g).tolist() for i in range(batch)]


def _hf_generate(hf, prompts: list[list[int]], new: int) -> torch.Tensor:
    from nightloom.train.rollout.generate import left_padded

    ids, pad = left_padded(prompts, None, 0)
    mask = (torch.arange(ids.shape[1])[None, :] >= pad[:, None]).long()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1] :]


def compare_generation(folder: Path, batch: int, new: int, repeats: int) -> None:
    import transformers

    from nightloom.hf.load import model_from_hf
    from nightloom.train.rollout.generate import generate
    from nightloom.train.rollout.sampling import SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly `new` tokens, as the native run (no EOS)
    ours = model_from_hf(folder, 256).eval()
    prompts = _prompts(batch, hf.config.vocab_size)
    params = SamplingParams(max_new_tokens=new, temperature=0)
    theirs_s, ours_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ref = _hf_generate(hf, prompts, new)
        theirs_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = generate(ours, prompts, params, eos_ids=[], pad_id=0)
        ours_s.append(time.perf_counter() - t0)
    same = float((out.tokens == ref).float().mean())
    tokens = batch * new
    a, b = statistics.median(theirs_s), statistics.median(ours_s)
    print(
        f"greedy, batch {batch} x {new} new tokens, {repeats} interleaved repeats (medians); tokens agree: {same:.1%}"
    )
    print(f"  transformers generate  {tokens / a:9.1f} tokens/s  ({a:.3f} s)")
    print(f"  nightloom native       {tokens / b:9.1f} tokens/s  ({b:.3f} s)")
    print(f"  native / transformers  {a / b:.2f}x  (target >= 1.0x)")


def grpo_step(folder: Path, prompts_per_step: int, group: int, new: int) -> None:
    from nightloom.hf.load import model_from_hf
    from nightloom.train.rollout.generate import generate, left_padded
    from nightloom.train.rollout.grpo import GRPOLossSettings, group_advantages, grpo_loss, loss_mask
    from nightloom.train.rollout.logps import completion_logps, rollout_batch
    from nightloom.train.rollout.rewards import RewardRef, load_rewards, score
    from nightloom.train.rollout.sampling import SamplingParams, rollout_generator

    model = model_from_hf(folder, 256).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    prompts = [p for p in _prompts(prompts_per_step, model.shape.vocab, seed=1) for _ in range(group)]
    rewards = load_rewards(
        [
            RewardRef("format", 1.0, {"pattern": r".*7.*"}),
            RewardRef("length", 0.5, {"max_tokens": new, "cache_tokens": 8}),
        ]
    )
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    t0 = time.perf_counter()
    model.eval()
    out = generate(model, prompts, params, eos_ids=[1], pad_id=0, generator=rollout_generator(0, 0, 0))
    t1 = time.perf_counter()
    ids = out.completion_ids()
    scores = score(rewards, [" ".join(map(str, p)) for p in prompts], [" ".join(map(str, c)) for c in ids], ids)
    adv = group_advantages(scores.total, group)
    t2 = time.perf_counter()
    model.train()
    ids_p, pad = left_padded(prompts, None, 0)
    logps = completion_logps(model, rollout_batch(ids_p, pad, out))
    mask = loss_mask(out.mask, out.truncated, mask_truncated=False)
    loss = grpo_loss(logps, out.logprobs, adv.values, mask, GRPOLossSettings("dapo")).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    total = t3 - t0
    print(f"one GRPO step: {prompts_per_step} prompts x {group} completions, <= {new} tokens (native, sampled)")
    for name, s in (("generation", t1 - t0), ("scoring", t2 - t1), ("training", t3 - t2)):
        print(f"  {name:<11} {s:7.3f} s  {s / total:6.1%}")
    print(f"  mean reward {float(scores.total.mean()):.3f}, mean length {float(out.lengths.float().mean()):.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group", type=int, default=4)
    args = ap.parse_args()
    from nightloom.hf.random_model import build_random_model

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        folder = build_random_model(
            Path(d) / "w", "llama", hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab,
            max_position_embeddings=512, initializer_range=0.3,
        )  # fmt: skip
        compare_generation(folder, args.batch, args.new, args.repeats)
        grpo_step(folder, max(1, args.batch // args.group), args.group, args.new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
