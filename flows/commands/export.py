"""`nightloom export RUN_DIR [--step N] --output DIR [--dtype bf16|fp32]`: a run's checkpoint as a Hugging
Face folder (config.json, generation_config.json, safetensors + index, tokenizer files) transformers loads."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from flows.commands.common import require_run_dir, usage


def register(sub) -> None:
    p = sub.add_parser("export", help="export a run's checkpoint as a Hugging Face model folder")
    p.add_argument("run_dir", help="the run folder (holds job-attempt*.json and checkpoints/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--output", required=True, help="folder to write (replaced atomically if it exists)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="tensor dtype of the export")
    p.set_defaults(func=run)


def _job(run_dir: Path):
    """The run's latest TrainJob (the orchestrator writes one per attempt; tests and notebooks write job.json)."""
    from nightloom.train.job import TrainJob

    found = sorted(run_dir.glob("job-attempt*.json"), key=lambda p: int(p.stem.rsplit("attempt", 1)[1] or 0))
    path = found[-1] if found else run_dir / "job.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no job-attempt*.json or job.json (not a nightloom run folder?)")
    try:
        return TrainJob.model_validate_json(path.read_text(encoding="utf-8"))
    except ValidationError as e:
        raise ValueError(f"{path}: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None


def run(args) -> int:
    require_run_dir(args.run_dir)  # before torch is imported: a wrong path fails at once (exit 2)
    from nightloom.hf.export import export_checkpoint
    from nightloom.train import checkpoint
    from nightloom.train.lora import LoraSettings

    run_dir = Path(args.run_dir)
    try:
        job = _job(run_dir)
        if args.step is None:
            found = checkpoint.latest(job.checkpoint_dir)
            if found is None:
                raise FileNotFoundError(f"{job.checkpoint_dir}: no complete checkpoint")
            ckpt, step = found
        else:
            ckpt, step = job.checkpoint_dir / f"step-{args.step}", args.step
            if not (ckpt / "meta.json").is_file():
                raise FileNotFoundError(f"{ckpt}: no complete checkpoint at step {args.step}")
        out = export_checkpoint(
            ckpt,
            job.model,
            Path(args.output),
            dtype=args.dtype,
            source_config=job.hf_config,
            tokenizer=job.tokenizer_dir,
            lora=LoraSettings.from_spec(job.train.lora),
            base=job.weights,
            chat_template=job.chat_template,
        )
    except (FileNotFoundError, ValueError) as e:  # no such checkpoint, or a job file that does not parse
        return usage("export", str(e))
    print(f"exported step {step} of {run_dir} to {out} ({args.dtype})")
    return 0
