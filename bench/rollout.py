"""Native generation against transformers' `generate`, and one GRPO step's split, one process on CPU, in one run.

One random Llama (transformers, fp32) is loaded twice: as transformers' model and as nightloom's native model
(nightloom.hf.load.model_from_hf). Both generate the same batch of prompts (different lengths, so left padding)
greedily for exactly --new tokens (no EOS), interleaved repeats, medians; the tokens must agree (they are the
same model), and the figure is generated tokens/s, native over transformers (target >= 1.0x).

Then one GRPO step on the native model, each part timed: generation (--group completions of each prompt,
sampled), scoring (a built-in format reward and the DAPO length term), training (the policy's log-probs through
the training forward, the dapo loss, backward, an AdamW step); printed next to the planner's predicted split for
the same model and sizes (nightloom/planner/post_training.py, generation.py) on this CPU described as a device:
its measured one-thread matmul peak (perf.measure_cpu_matmul_peak) and a measured read bandwidth, efficiency 1.
The planner models GPUs: on a CPU the figures say only whether the split has the right shape.

Last, DPO's reference pass (train/preference/reference.score_pairs, a no-grad forward of chosen and rejected)
against one DPO step over the same pairs (forward, backward, AdamW): its measured share of the time and its FLOPs
(torch's FlopCounterMode) against the planner's (a forward is a third of a step's FLOPs).

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/rollout.py [--hidden 256] [--layers 4] [--batch 8] [--new 64] [--pairs 4]
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


def cpu_device():
    """This CPU as the planner's device record: the measured one-thread fp32 matmul peak and read bandwidth
    (best of 5 sums of a 256 MiB tensor)."""
    from nightloom.catalog import GPUSpec
    from nightloom.perf import measure_cpu_matmul_peak

    peak = measure_cpu_matmul_peak().flops
    x = torch.ones(64 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    bw = x.nbytes / best
    print(f"this CPU as a device: matmul peak {peak / 1e9:.1f} GFLOP/s (1 thread), read bandwidth {bw / 1e9:.1f} GB/s")
    return GPUSpec("cpu", peak, peak, 0, 1e9, 1e9, 0.0, 0.0, "measured", bw)


def predicted_grpo(shape, rows: int, prompt: int, new: int, device) -> dict[str, float]:
    """The planner's split of one GRPO step (iterations 1, beta 0) on one rank: all rows in one forward."""
    from nightloom.parallel import ParallelDims
    from nightloom.planner.generation import generation
    from nightloom.planner.steptime import step_time

    gen = generation(shape, ParallelDims(), rows, prompt, new, device, 1, 1.0, "fp32")
    train = step_time(shape, ParallelDims(micro_batch=rows), prompt + new, device, 1, 1.0, "fp32")
    return {"generation": gen.total_s, "scoring": 0.0, "training": train.step_s}


def grpo_step(folder: Path, prompts_per_step: int, group: int, new: int, device) -> None:
    from nightloom.hf.load import model_from_hf
    from nightloom.train.rollout.generate import generate, left_padded
    from nightloom.train.rollout.grpo import GRPOLossSettings, group_advantages, grpo_loss, loss_mask
    from nightloom.train.rollout.logps import completion_logps, rollout_batch
    from nightloom.train.rollout.rewards import RewardRef, load_rewards, score
    from nightloom.train.rollout.sampling import SamplingParams, group_generators

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
    gens = group_generators(0, 0, 0, prompts_per_step, group)  # each group its own RNG, as the trainer samples
    out = generate(model, prompts, params, eos_ids=[1], pad_id=0, generator=gens)
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
    width = max(len(p) for p in prompts)
    plan = predicted_grpo(model.shape, len(prompts), width, new, device)
    planned = sum(plan.values())
    print(f"one GRPO step: {prompts_per_step} prompts x {group} completions, <= {new} tokens (native, sampled)")
    print(f"  {'':<11} {'measured':>9} {'share':>7}   {'planner':>9} {'share':>7}  (prompts padded to {width})")
    for name, s in (("generation", t1 - t0), ("scoring", t2 - t1), ("training", t3 - t2)):
        p = plan[name]
        print(f"  {name:<11} {s:7.3f} s {s / total:7.1%}   {p:7.3f} s {p / planned:7.1%}")
    print("  (the planner: every completion at its longest, reward functions not modelled; CPU: shape only)")
    print(f"  mean reward {float(scores.total.mean()):.3f}, mean length {float(out.lengths.float().mean()):.1f}")


def dpo_reference(folder: Path, pairs: int, seq: int, repeats: int, device) -> None:
    """DPO's reference pass against a DPO step over the same pairs: measured time share and FLOPs vs the planner."""
    from contextlib import nullcontext

    from torch.utils.flop_counter import FlopCounterMode

    from nightloom.hf.load import model_from_hf
    from nightloom.parallel import ParallelDims
    from nightloom.perf import flops_per_token
    from nightloom.planner.generation import forward_flops, no_grad_forward_s
    from nightloom.planner.steptime import step_time
    from nightloom.train.preference.logps import sequence_logps
    from nightloom.train.preference.losses import LossSettings, pair_loss
    from nightloom.train.preference.reference import score_pairs

    model = model_from_hf(folder, seq).train()
    shape, rows = model.shape, 2 * pairs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randint(3, shape.vocab, (rows, seq), generator=g) for _ in range(2))

    def reference():
        got = score_pairs(model, x, y, nullcontext).halves()
        return got[0].total, got[1].total

    def step(ref):
        policy = sequence_logps(model(x), y).halves()
        pair_loss(policy, ref, LossSettings("sigmoid")).losses.sum().backward()
        opt.step()
        opt.zero_grad()

    ref_s, step_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ref = reference()
        t1 = time.perf_counter()
        step(ref)
        ref_s.append(t1 - t0)
        step_s.append(time.perf_counter() - t1)
    a, b = statistics.median(ref_s), statistics.median(step_s)
    c = ParallelDims(micro_batch=rows)
    p_ref = no_grad_forward_s(shape, c, rows, rows, seq, device, 1, 1.0, "fp32")
    p_step = step_time(shape, c, seq, device, 1, 1.0, "fp32").step_s
    with FlopCounterMode(display=False) as fwd:
        ref = reference()
    with FlopCounterMode(display=False) as full:
        step(ref)
    print(f"dpo: {pairs} pairs x 2 rows x {seq} tokens, {repeats} repeats (medians)")
    print(
        f"  reference pass {a:.3f} s, step {b:.3f} s: measured share {a / (a + b):.1%}, planner {p_ref / (p_ref + p_step):.1%}"
    )
    planned = forward_flops(shape, seq) / flops_per_token(shape, seq, lm_head=True)
    print(
        f"  FLOPs (FlopCounterMode): reference {fwd.get_total_flops() / 1e9:.2f} G, step {full.get_total_flops() / 1e9:.2f} G: "
        f"ratio {fwd.get_total_flops() / full.get_total_flops():.3f}, planner {planned:.3f}; planner's reference "
        f"{rows * seq * forward_flops(shape, seq) / 1e9:.2f} G"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=4, help="DPO pairs for the reference-pass comparison")
    ap.add_argument("--pair-len", type=int, default=128, help="tokens of each DPO row")
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
        device = cpu_device()
        grpo_step(folder, max(1, args.batch // args.group), args.group, args.new, device)
        dpo_reference(folder, args.pairs, args.pair_len, args.repeats, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
