"""Runs XTuner's tools inside the XTuner env (never the `xtuner` CLI, which exits 0 on failure).

Usage (by the env's interpreter, one process per rank under torch.distributed.run for `train`):
    python node_wrapper.py probe
    python node_wrapper.py prepare CONFIG            # tokenize + pack `prepare_dataset`, save it, write stats
    python node_wrapper.py train CONFIG [xtuner train args...]
    python node_wrapper.py pth_to_hf CONFIG PTH OUT [args...]
    python node_wrapper.py merge BASE ADAPTER OUT [args...]

Standalone on purpose: imports only the standard library, torch and xtuner (never nightloom or its
orchestrator deps). When CUDA is absent it applies the two CPU adaptations from
shared/notes/xtuner-on-cpu.md before any xtuner code runs. Exit codes propagate: 0 ok, 1 a crash in a tool,
2 usage, 3 an empty processed dataset.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

# Run as a script, this folder is sys.path[0]; its modules (config.py, env.py...) must not shadow anything.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
# The modules the rendered config names by import path (nightloom_micro.MicroBatchDDP); standalone like this file.
EXT = Path(__file__).resolve().parent / "xtuner_ext"

EXIT_USAGE = 2
EXIT_EMPTY_DATASET = 3
STATS_FILE = "nightloom_stats.json"
# Columns that map functions read as lists of dicts; nightloom shards store them JSON-encoded (keep_columns).
JSON_COLUMNS = {"openai_map_fn": ("messages",), "wizardlm_map_fn": ("conversations",)}


def apply_cpu_patches() -> bool:
    """Patch the two CUDA-only calls XTuner makes when there is no GPU; return whether patches were applied."""
    import torch

    if torch.cuda.is_available():
        return False
    # xtuner/model/sft.py and tools/utils.py call get_torch_device().is_bf16_supported(): torch.cpu lacks it.
    torch.cpu.is_bf16_supported = lambda including_emulation=True: False
    # mmengine/dist/utils.py _init_dist_pytorch calls torch.cuda.set_device(local_rank) unconditionally.
    torch.cuda.set_device = lambda *a, **k: None
    return True


def _tool(*parts: str) -> str:
    import xtuner

    return str(Path(xtuner.__file__).parent.joinpath("tools", *parts))


def _run_tool(path: str, argv: list[str]) -> int:
    """Run an xtuner tool as __main__ with `argv`; a raised exception exits 1 (traceback on stderr)."""
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:  # argparse errors, explicit exits
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def cmd_probe() -> int:
    import importlib.metadata as md

    import torch
    from xtuner.dataset import map_fns
    from xtuner.utils import PROMPT_TEMPLATE

    names = ["xtuner", "torch", "transformers", "datasets", "mmengine", "peft", "bitsandbytes", "accelerate"]
    versions = {}
    for n in names:
        try:
            versions[n] = md.version(n)
        except md.PackageNotFoundError:
            versions[n] = None
    info = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "cuda": torch.cuda.is_available(),
        "profile": "gpu" if torch.cuda.is_available() else "cpu",
        "versions": versions,
        "map_fns": sorted(n for n in dir(map_fns) if n.endswith("_map_fn")),
        "templates": sorted(PROMPT_TEMPLATE.keys()),
    }
    print(json.dumps(info))
    return 0


def _empty_dataset_symptom(e: BaseException) -> bool:
    import traceback

    if isinstance(e, ValueError):
        return "Column 'length' doesn't exist" in str(e)
    last = traceback.extract_tb(e.__traceback__)[-1]
    return last.filename.endswith(os.path.join("xtuner", "dataset", "huggingface.py")) and "input_ids" in (
        last.line or ""
    )


def decode_json_columns(example: dict, *, map_fn, columns: tuple[str, ...]) -> dict:
    """Decode the JSON-encoded list/dict columns of a shard row, then apply the XTuner map function."""
    for c in columns:
        v = example.get(c)
        if isinstance(v, str) and v[:1] in ("[", "{"):
            example = {**example, c: json.loads(v)}
    return map_fn(example)


def seed_shuffle(seed: int | None) -> None:
    """Seed the global RNGs the prepare step draws from: xtuner shuffles before packing with datasets'
    `Dataset.shuffle()` and no seed, which then takes one from numpy's global RNG. Unseeded, every prepare packed
    the samples in another order, so two runs of one spec trained on different batches from step 1 (a 4-step
    LoRA run's loss drop went from +1.0% to -0.1% between runs) while the prepare key, which holds the seed, called
    the cached dataset up to date."""
    if seed is None:
        return
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)


def cmd_prepare(config: str) -> int:
    """Build the config's `prepare_dataset` (map, template, tokenize, pack) once and save it to `processed_dir`."""
    import functools

    from mmengine.config import Config
    from xtuner.registry import BUILDER

    cfg = Config.fromfile(config)
    out = Path(cfg.processed_dir)
    columns = JSON_COLUMNS.get(cfg.get("map_fn_name") or "", ())
    if columns:
        map_fn = cfg.prepare_dataset["dataset_map_fn"]
        cfg.prepare_dataset["dataset_map_fn"] = functools.partial(decode_json_columns, map_fn=map_fn, columns=columns)
    seed_shuffle(cfg.get("seed"))
    try:
        ds = BUILDER.build(cfg.prepare_dataset)
        rows, why = len(ds), ""
    except (AssertionError, ValueError) as e:
        # xtuner reports an empty dataset obliquely: the `{"input_ids", "labels"}` assert (nothing was
        # tokenized) or `Column 'length' doesn't exist` (everything was filtered). Anything else is a crash.
        if not _empty_dataset_symptom(e):
            raise
        rows, why = 0, f" ({type(e).__name__} inside xtuner: {e or 'input_ids/labels missing'})"
    if rows == 0:
        print(
            f"nightloom: the processed dataset is EMPTY{why} (config {config}): map function "
            f"{cfg.get('map_fn_name')!r} and template {cfg.get('template_name')!r} over {len(cfg.data_files)} "
            f"file(s) left no sample with a trainable label; check the columns the map function needs and "
            f"that prompts fit max_length={cfg.max_length}",
            file=sys.stderr,
        )
        return EXIT_EMPTY_DATASET
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    ds.save_to_disk(str(tmp))
    lengths = list(ds["length"])
    stats = {
        "rows": rows,
        "tokens": int(sum(lengths)),
        "max_length": int(max(lengths)),
        "label_tokens": int(sum(sum(1 for t in lab if t >= 0) for lab in ds["labels"])),
    }
    (tmp / STATS_FILE).write_text(json.dumps(stats) + "\n", encoding="utf-8")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    print("nightloom: processed " + json.dumps(stats))
    return 0


def die_with_parent() -> None:
    """A training rank dies with its torchrun agent (Linux PR_SET_PDEATHSIG): torchrun starts each worker in
    a session of its own, so a teardown that kills the agent's process group (ssh as root cannot signal the
    session) would otherwise leave the rank running until its collective timeout."""
    if not sys.platform.startswith("linux") or "LOCAL_RANK" not in os.environ:
        return
    import ctypes
    import signal

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)


def _say(line: str) -> None:
    """One line to stderr in one write: every rank on a node shares its stderr, and print's two writes (the text,
    then the newline, when Python runs unbuffered) interleaved there into "…applied…applied" and a blank line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return EXIT_USAGE
    mode, rest = argv[0], argv[1:]
    # mmengine checkpoints pickle HistoryBuffer etc.; torch>=2.6 loads weights_only by default (breaks --resume).
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    patched = apply_cpu_patches()
    if mode == "probe":
        return cmd_probe()
    if mode == "prepare" and len(rest) == 1:
        return cmd_prepare(rest[0])
    if mode == "train" and rest:
        die_with_parent()
        sys.path.insert(0, str(EXT))
        if patched:
            _say("nightloom: CUDA absent: CPU adaptations applied")
        return _run_tool(_tool("train.py"), rest)
    if mode == "pth_to_hf" and len(rest) >= 3:
        return _run_tool(_tool("model_converters", "pth_to_hf.py"), rest)
    if mode == "merge" and len(rest) >= 3:
        return _run_tool(_tool("model_converters", "merge.py"), rest)
    print(f"node_wrapper: bad usage: {argv!r}\n{__doc__}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
