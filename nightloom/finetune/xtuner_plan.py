"""An XTuner run's plan: every input checked and the config rendered, before any rank starts.

`plan_xtuner` fails (XTunerConfigError) on anything wrong with the spec, the base model, the shards or the
env; `plan_for_world` re-renders the config for the world size recovery left. The plan also says what one
step means (tokens, FLOPs per token, the peak) for the metrics.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from nightloom.finetune import config as xcfg
from nightloom.finetune.base_model import BaseSource, base_source, check_source, check_tokenizer, fetch_cached
from nightloom.finetune.env import XTunerEnv, ensure_env
from nightloom.finetune.launcher import WRAPPER
from nightloom.records import Record
from nightloom.spec import RunSpec
from nightloom.storage import S3Config

Log = Callable[[str], None]


class XTunerPlan(Record):
    """A checked, rendered XTuner run: where everything is and what one step means."""

    python: str
    env_key: str
    profile: str
    method: str
    merge_lora: bool
    base_model: str
    run_dir: str
    config_path: str
    work_dir: str
    processed_dir: str
    log_dir: str
    world_size: int
    micro_batch: int = 0  # sequences per forward pass
    micro_batches: int = 1  # forward/backward passes per rank per step
    total_steps: int
    tokens_per_step: int
    flops_per_token: float | None = None
    peak_flops: float | None = None
    peak_source: str | None = None
    deepspeed: str | None = None
    data_files: list[str]
    prepare_key: str
    wrapper: str = str(WRAPPER)  # node_wrapper.py as the nodes see it (remote.wrapper_path)
    node_pythons: dict[str, str] = Field(default_factory=dict)  # node name -> its XTuner env's interpreter


def shard_files(spec: RunSpec, manifest) -> list[Path]:
    """Local shard paths from a manifest folder/file path, or a ShardManifest read from `spec.sharding.output`."""
    from nightloom.sharding.manifest import MANIFEST_NAME, ShardManifest, load_manifest

    if isinstance(manifest, ShardManifest):
        base, m = spec.sharding.output, manifest
    else:
        base = str(manifest)
        if base.endswith(".json"):
            base = str(Path(base).parent)
        m = load_manifest(base)
    if base.startswith("s3://"):
        raise xcfg.XTunerConfigError(
            f"dataset: shards at {base}: the XTuner backend reads local shards; stage them with nightloom.sharding first"
        )
    root = Path(base)
    if root.name == MANIFEST_NAME:
        root = root.parent
    return [root / s.path for s in sorted(m.shards, key=lambda s: s.index)]


def _base_config(src: BaseSource, base: Path, xdir: Path, spec: RunSpec) -> Path:
    """The base model's config.json as this machine sees it: in the folder, or (a node's cache this machine
    does not share) fetched from the s3:// source."""
    cfg = base / "config.json"
    if cfg.is_file() or not src.is_s3:
        return cfg
    from nightloom import storage

    return storage.get_file(
        storage.join(src.uri, "config.json"), xdir / "base_config.json", S3Config.from_spec(spec.storage)
    )


def _hf_flops_per_token(config: Path, seq_len: int, frozen_base: bool = False) -> float | None:
    """PaLM FLOPs/token (nightloom.perf) of the base model's config.json, through the one model resolver (shape
    only: XTuner, not the native model, computes it); None when it cannot be read or describes an architecture
    nightloom does not know. frozen_base for LoRA/QLoRA (no gradients for the base weights)."""
    from nightloom.model_resolver import shape_from_name_or_config
    from nightloom.perf import flops_per_token

    try:
        shape = shape_from_name_or_config(config, strict=False)
    except ValueError:
        return None
    return flops_per_token(shape, seq_len, frozen_base=frozen_base)


def _peak(spec: RunSpec, profile: str, peak_flops: float | None) -> tuple[float | None, str | None]:
    if peak_flops is not None:
        return peak_flops, "given"
    from nightloom.catalog import GPU_ALIASES, GPUS
    from nightloom.perf import resolve_peak, resolve_precision

    gpu = GPU_ALIASES.get(spec.cluster.gpu_type.lower(), spec.cluster.gpu_type.lower())
    if gpu in GPUS:
        peak = resolve_peak(gpu, resolve_precision("auto", profile))
        return peak.flops, peak.source
    if profile == "cpu":  # the native trainer's measurement (same size, repeats, one thread): comparable MFU
        from nightloom.perf import measure_cpu_matmul_peak

        m = measure_cpu_matmul_peak()
        return m.flops, m.source
    return None, None


def _prepare_key(files: list[Path], rendered_values: dict) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(json.dumps(rendered_values, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")


def build_tiny_model(env: XTunerEnv, out: Path, log: Log = print) -> Path:
    """A tiny random Llama + tokenizer at `out`, built by the XTuner env (demo and tests; no hub access)."""
    r = subprocess.run(
        [str(env.python), str(TINY_MODEL_SCRIPT), str(out)], capture_output=True, text=True, timeout=600, check=False
    )
    if r.returncode != 0:
        raise xcfg.XTunerConfigError(f"train.xtuner.build_tiny_base_model: building {out} failed: {r.stderr[-800:]}")
    log(f"xtuner: built the tiny base model at {out}")
    return out


#: the render inputs that decide the prepared (tokenized) data set: a change in any of them prepares it anew
_PREPARE_KEYS = (
    "base_model",
    "tokenizer_path",
    "data_files",
    "map_fn_name",
    "template_name",
    "max_length",
    "pack_to_max_length",
    "seed",
)


def _base_folder(spec: RunSpec, src, base_path: str | None, env: XTunerEnv | None, log: Log):
    """(the base model's folder on this machine, the env if building the tiny base needed one)."""
    xs = spec.train.xtuner
    if base_path is not None:  # fetched on the nodes and checked there (remote.ensure_node_models)
        return Path(base_path), env
    if src.is_s3:
        return Path(fetch_cached(src.uri, s3=S3Config.from_spec(spec.storage), log=log).path), env
    if xs.build_tiny_base_model and not Path(src.uri).exists():
        env = env or ensure_env(python=xs.python, log=log)
        build_tiny_model(env, Path(src.uri), log)
    check_source(src)
    return Path(src.uri), env


def _render_inputs(
    tr, xs, profile, base, tokenizer, files, data_format, map_fn, template, xdir: Path, world: int, passes: int
) -> xcfg.RenderInputs:
    """The values the XTuner config template is rendered with."""
    save_steps = tr.checkpoint_every or tr.steps
    return xcfg.RenderInputs(
        profile=profile,
        method=xs.method,
        base_model=str(base),
        tokenizer_path=str(tokenizer) if tokenizer else None,
        data_files=[str(f) for f in files],
        data_format=data_format,
        map_fn=map_fn,
        template=template,
        work_dir=str(xdir / "work_dir"),
        processed_dir=str(xdir / "processed"),
        hf_cache_dir=str(xdir / "hf_cache"),
        max_length=tr.seq_len,
        batch_size=tr.global_batch // world,
        micro_batches=passes,
        sampler_pad_to=world * passes,
        max_iters=tr.steps,
        warmup_iters=min(tr.warmup_steps, tr.steps),
        lr=tr.lr,
        min_lr_ratio=tr.min_lr_ratio,
        weight_decay=tr.weight_decay,
        max_norm=tr.grad_clip,
        save_steps=save_steps,
        seed=tr.seed,
        dist_timeout_s=tr.collective_timeout_s,
        amp_dtype="float16" if xs.amp == "fp16" else "bfloat16",
        sequence_parallel_size=xs.sequence_parallel_size,
    )


def plan_xtuner(
    spec: RunSpec,
    manifest,
    run_dir: str | Path,
    *,
    world_size: int | None = None,
    env: XTunerEnv | None = None,
    peak_flops: float | None = None,
    log: Log = print,
    base_path: str | None = None,
    micro_batch: int | None = None,
) -> XTunerPlan:
    """Check every input, find or build the env, and render the config. Raises XTunerConfigError before launch.
    `base_path`: the base model's folder where the nodes fetched it (default: resolved on this machine).
    `micro_batch`: sequences per forward (default train.xtuner.micro_batch, else global_batch / world_size);
    recovery passes the first plan's, so fewer ranks accumulate more passes and a step stays the same."""
    xs = spec.train.xtuner
    if xs is None:
        raise xcfg.XTunerConfigError("train.xtuner: required when train.backend is 'xtuner'")
    tr = spec.train
    map_fn = xcfg.resolve_map_fn(xs.map_fn)
    template = xcfg.check_template(xs.template)
    src = base_source(spec)
    base, env = _base_folder(spec, src, base_path, env, log)
    tokenizer = check_tokenizer(src.tokenizer) if src.tokenizer else None
    files = shard_files(spec, manifest)
    data_format = xcfg.check_data_files(files, map_fn)
    world = world_size or spec.world_size
    passes = xcfg.micro_batches(
        tr.global_batch, world, micro_batch or xs.micro_batch, xs.zero_stage, xs.sequence_parallel_size
    )
    env = env or ensure_env(python=xs.python, log=log)
    profile = env.profile if env.profile in ("cpu", "gpu") else ("gpu" if env.versions.get("cuda") else "cpu")
    xcfg.check_profile(profile, xs.method, xs.zero_stage, xs.sequence_parallel_size)

    run_dir = Path(run_dir).resolve()
    xdir = run_dir / "xtuner"
    inputs = _render_inputs(tr, xs, profile, base, tokenizer, files, data_format, map_fn, template, xdir, world, passes)
    cfg_path = xcfg.render_config(inputs, xdir / "config.py")
    pkey_values = {k: v for k, v in inputs.values().items() if k in _PREPARE_KEYS}
    peak, peak_source = _peak(spec, profile, peak_flops)
    return XTunerPlan(
        python=str(env.python),
        env_key=env.key,
        profile=profile,
        method=xs.method,
        merge_lora=xs.merge_lora,
        base_model=str(base),
        run_dir=str(run_dir),
        config_path=str(cfg_path),
        work_dir=inputs.work_dir,
        processed_dir=inputs.processed_dir,
        log_dir=str(xdir / "logs"),
        world_size=world,
        micro_batch=tr.global_batch // world // passes,
        micro_batches=passes,
        total_steps=tr.steps,
        tokens_per_step=tr.global_batch * tr.seq_len,
        flops_per_token=_hf_flops_per_token(
            _base_config(src, base, xdir, spec), tr.seq_len, frozen_base=xs.method != "full"
        ),
        peak_flops=peak,
        peak_source=peak_source,
        deepspeed=f"deepspeed_zero{xs.zero_stage}" if xs.zero_stage else None,
        data_files=inputs.data_files,
        prepare_key=_prepare_key(files, pkey_values),
    )


def plan_for_world(
    spec: RunSpec, manifest, first: XTunerPlan, world: int, *, env=None, base_path=None, log: Log = print
) -> XTunerPlan:
    """The config for `world` ranks after recovery: the first plan's micro-batch, so each rank accumulates the
    forwards of the ranks that left and a step's gradient is kept; where that cannot be (DeepSpeed, or a world
    the micro-batch does not fit, as 3 ranks -> 2), each rank takes global_batch / world at once (said in the log)."""
    again = dict(world_size=world, env=env, peak_flops=first.peak_flops, base_path=base_path or first.base_model)
    try:
        return plan_xtuner(spec, manifest, first.run_dir, micro_batch=first.micro_batch, **again)
    except xcfg.XTunerConfigError as e:
        log(f"xtuner: {e}; the {world} rank(s) take global_batch / world size each instead (steps differ)")
        whole = spec.train.global_batch // world if spec.train.global_batch % world == 0 else None
        return plan_xtuner(spec, manifest, first.run_dir, micro_batch=whole, **again)
