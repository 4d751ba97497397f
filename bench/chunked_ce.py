"""Chunked cross-entropy fused with the head (train/loss.py) against the plain loss (whole logits, then
F.cross_entropy), at vocab 128k on CPU, measured in one run: peak memory and time of one forward + backward of
the head and loss, printed as ratios (chunked / plain).

Each measurement runs in a fresh subprocess (so one's peak cannot hide another's): it builds the final hidden
states (tokens x hidden, requires grad) and the head weight (vocab x hidden), runs one warm-up step, then resets
the process's RSS high-water mark (VmHWM via /proc/self/clear_refs, as the trainer's peak_memory_bytes does) and
times one more. Peak = VmHWM after the step less the RSS before it: what the loss adds. Repeats alternate the two.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/chunked_ce.py [--tokens 2048] [--hidden 256] [--vocab 128256]
       [--chunk 256] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(kind: str, tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    """One step's (peak bytes added, seconds) for `kind` plain or chunked, in this process."""
    import torch
    import torch.nn.functional as F

    from nightloom.train.loss import chunked_nll_sum

    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g)

    def step() -> float:
        if kind == "plain":
            loss = F.cross_entropy(F.linear(h, w).float(), y)
        else:
            loss = chunked_nll_sum(h, w, y, vocab, None, chunk) / tokens
        loss.backward()
        h.grad = w.grad = None
        return float(loss)

    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    base = _rss("VmRSS")
    t0 = time.perf_counter()
    loss = step()
    secs = time.perf_counter() - t0
    return {"peak": _rss("VmHWM") - base, "secs": secs, "loss": loss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", choices=("plain", "chunked"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.tokens, a.hidden, a.vocab, a.chunk)))
        return 0
    runs: dict[str, list[dict]] = {"plain": [], "chunked": []}
    for _ in range(a.repeats):
        for kind in runs:
            cmd = [sys.executable, __file__, "--one", kind]
            cmd += ["--tokens", str(a.tokens), "--hidden", str(a.hidden), "--vocab", str(a.vocab)]
            cmd += ["--chunk", str(a.chunk)]
            p = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            runs[kind].append(json.loads(p.stdout.strip().splitlines()[-1]))
    peak = {k: statistics.median(r["peak"] for r in v) for k, v in runs.items()}
    secs = {k: statistics.median(r["secs"] for r in v) for k, v in runs.items()}
    logits = a.tokens * a.vocab * 4
    print(f"head + cross-entropy, one forward + backward, CPU fp32, 1 thread: {a.tokens} tokens x hidden "
          f"{a.hidden}, vocab {a.vocab:,} (fp32 logits {logits / 2**30:.2f} GiB), chunk {a.chunk} tokens, "
          f"median of {a.repeats} fresh processes each")  # fmt: skip
    for k in runs:
        print(f"  {k:8s} peak added {peak[k] / 2**20:8.0f} MiB   time {secs[k]:.2f} s   loss {runs[k][0]['loss']:.6f}")
    print(
        f"chunked / plain: peak memory {peak['chunked'] / peak['plain']:.2f}x, time {secs['chunked'] / secs['plain']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
