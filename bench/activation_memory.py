"""What one training step holds for backward, the trainer's blocks against plain autograd, in one run on CPU.

The trainer (train/model.py) recomputes its RMSNorms and act(g) in backward and lets SDPA take grouped K/V heads
(enable_gqa); the baseline is the same model with those three undone in this process (the norm and the gated MLP
as plain autograd runs them, K/V repeated to every query head), the bytes autograd saves before backward as
before this change. Printed: the bytes each step saves (saved-tensor hooks, every storage once; the whole model,
embedding and head included, per token, layer and h), the planner's count for the trainer's layers
(planner/activations.py), and the ratios trainer / baseline of the saved bytes and the step time. (Saved bytes,
not RSS: freed memory stays mapped in one process, so a later step's RSS high-water mark shows nothing.)

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/activation_memory.py [--seq 2048] [--hidden 1024] [--layers 4]
       [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nightloom.catalog import MODELS  # noqa: E402
from nightloom.planner.activations import saved_bytes_per_token  # noqa: E402
from nightloom.train import model as model_mod  # noqa: E402
from nightloom.train.model import build_model  # noqa: E402


@contextlib.contextmanager
def plain_autograd(model):
    """The baseline: norms and the gated MLP without recompute, K/V heads repeated (this process only)."""
    norm_fwd, ffn_fwd = model_mod.RMSNorm.forward, model_mod.FeedForward.forward
    model_mod.RMSNorm.forward = model_mod.RMSNorm._normalise
    model_mod.FeedForward.forward = lambda self, x: self.w2(self._glu(self.w1(x), self.w3(x)))
    model.expand_kv_heads()
    try:
        yield
    finally:
        model_mod.RMSNorm.forward, model_mod.FeedForward.forward = norm_fwd, ffn_fwd
        for block in model.layers.values():
            block.attn.expand_kv = False


def one_step(model, tokens, targets) -> tuple[float, float]:
    """(saved bytes, seconds) of one forward + backward."""
    params = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return float(sum(seen.values())), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    big = MODELS["llama3-405b"]  # its GQA ratio (16:1) and MLP width (3.25 h)
    shape = big.with_(
        hidden=a.hidden, heads=32, kv_heads=2, ffn_hidden=int(a.hidden * 3.25), layers=a.layers, vocab=2048
    )
    torch.manual_seed(0)
    model = build_model(shape, a.seq, device="cpu").to(torch.bfloat16)
    tokens = torch.randint(0, shape.vocab, (1, a.seq))
    targets = torch.randint(0, shape.vocab, (1, a.seq))
    runs: dict[str, list[tuple[float, float]]] = {"trainer": [], "baseline": []}
    one_step(model, tokens, targets)  # warm-up
    for _ in range(a.repeats):  # alternate, so drift hits both alike
        runs["trainer"].append(one_step(model, tokens, targets))
        with plain_autograd(model):
            runs["baseline"].append(one_step(model, tokens, targets))
    per = a.seq * a.layers * a.hidden
    med = {k: [statistics.median(r[i] for r in v) for i in range(2)] for k, v in runs.items()}
    planned = saved_bytes_per_token(shape, a.seq, 1, False, "none") / a.hidden
    print(f"Llama-405B-shaped: h={a.hidden}, {a.layers} layers, seq {a.seq}, bf16, CPU, {a.repeats} steps each")
    for k in ("baseline", "trainer"):
        saved, secs = med[k]
        print(f"  {k:8s}: saved {saved / per:5.1f} bytes/(token·layer·h), step {secs:.3f} s")
    print(f"  planner's count for the trainer: {planned:.1f} bytes/(token·layer·h) (Table 2: 34)")
    t, b = med["trainer"], med["baseline"]
    print(f"  ratios trainer/baseline: saved {t[0] / b[0]:.2f}x, step time {t[1] / b[1]:.2f}x")


if __name__ == "__main__":
    main()
