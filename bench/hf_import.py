"""Import speed of a sharded Hugging Face checkpoint, one process on CPU, measured in one run (a ratio).

A random Llama (transformers, fp32, saved in several safetensors files + index) is read (a) with
`safetensors.torch.load_file` alone and (b) by nightloom.hf.load.load_hf_weights into the native model
(header scan + DCP HuggingFaceStorageReader + copy into the parameters). Interleaved repeats, medians; the
page cache is warm for both after the first read.

Usage: OMP_NUM_THREADS=1 .venv/bin/python bench/hf_import.py [--hidden 512] [--layers 8] [--repeats 3]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from safetensors.torch import load_file

    from nightloom.hf.config import shape_from_hf_config
    from nightloom.hf.load import load_hf_weights
    from nightloom.hf.random_model import build_random_model
    from nightloom.train.model import build_model

    with tempfile.TemporaryDirectory() as d:
        folder = build_random_model(
            Path(d) / "w", "llama", hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
            max_shard_size="50MB",
        )  # fmt: skip
        files = sorted(folder.glob("*.safetensors"))
        mib = sum(f.stat().st_size for f in files) / 2**20
        shape = shape_from_hf_config(folder)
        model = build_model(shape, 128, device="meta").to_empty(device="cpu")
        plain, ours = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for f in files:
                load_file(str(f))
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            load_hf_weights([model], folder, shape)
            ours.append(time.perf_counter() - t0)
        p, o = statistics.median(plain), statistics.median(ours)
        print(f"{mib:.0f} MiB in {len(files)} files; safetensors alone {mib / p:,.0f} MiB/s; "
              f"nightloom.hf.load {mib / o:,.0f} MiB/s; time ratio {o / p:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
