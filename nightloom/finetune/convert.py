"""Turn an XTuner checkpoint into a Hugging Face model (LoRA merged when asked) and write it to storage.

`convert_checkpoint` is the run's step: pth -> HF (adapter for LoRA), merge when asked, publish.

Each step runs in the XTuner env through node_wrapper.py and is checked twice: the exit code, then the
files a loader needs (the tools print errors and still leave folders behind).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nightloom.finetune.launcher import WRAPPER, Runner, check, local_runner, tool_command
from nightloom.finetune.xtuner_plan import XTunerPlan
from nightloom.hf.export import ADAPTER_DIR
from nightloom.util import share_mode


class XTunerConvertError(RuntimeError):
    """A conversion left no loadable model; names the folder and what is missing."""


def find_checkpoint(work_dir: Path) -> Path | None:
    """The newest mmengine checkpoint of a work dir (`last_checkpoint` names it), or None."""
    work_dir = Path(work_dir)
    marker = work_dir / "last_checkpoint"
    if marker.is_file():
        p = Path(marker.read_text(encoding="utf-8").strip())
        p = p if p.is_absolute() else work_dir / p
        if p.exists():
            return p
    ckpts = sorted(work_dir.glob("iter_*.pth"), key=lambda q: int(q.stem.split("_")[1]))
    return ckpts[-1] if ckpts else None


def _has_weights(d: Path) -> bool:
    return any(d.glob("*.safetensors")) or any(d.glob("pytorch_model*.bin"))


def check_hf_model(d: Path) -> Path:
    """A full Hugging Face model: config.json and weights."""
    missing = [n for n, ok in (("config.json", (d / "config.json").is_file()), ("weights", _has_weights(d))) if not ok]
    if missing:
        raise XTunerConvertError(f"{d}: not a Hugging Face model: missing {', '.join(missing)}")
    return d


def check_adapter(d: Path) -> Path:
    """A PEFT adapter: adapter_config.json and adapter weights."""
    ok = (d / "adapter_config.json").is_file() and any(d.glob("adapter_model.*"))
    if not ok:
        raise XTunerConvertError(f"{d}: not a LoRA adapter: needs adapter_config.json and adapter_model.*")
    return d


@dataclass(frozen=True)
class ToolRun:
    """Where and how the conversion steps run: their log, `runner` (default: this machine, `timeout_s` each) and
    node_wrapper.py as that place sees it (`wrapper`)."""

    log_file: Path
    log: Callable[[str], None] = print
    timeout_s: float = 1800
    runner: Runner | None = None
    wrapper: str | Path = WRAPPER

    def into(self, python: Path | str, step: str, out: Path, *args: str | Path) -> Path:
        """Run the wrapper's `step` with `args` into a fresh `out` (an older one removed first); its exit code
        checked (XTunerLaunchError with the log's tail); returns `out`."""
        if out.exists():
            shutil.rmtree(out)
        cmd = tool_command(python, step, *args, wrapper=self.wrapper)
        check((self.runner or local_runner(self.timeout_s))(cmd, self.log_file, self.log, step), step, self.log_file)
        return out


def pth_to_hf(python: Path | str, config: Path, pth: Path, out: Path, *, lora: bool, tools: ToolRun) -> Path:
    """xtuner's pth_to_hf (fp32, safetensors); returns `out`, an adapter folder for LoRA else a full model."""
    tools.into(python, "pth_to_hf", out, config, pth, out, "--fp32", "--safe-serialization")
    return check_adapter(out) if lora else check_hf_model(out)


def merge_lora(python: Path | str, base: Path, adapter: Path, out: Path, *, device: str, tools: ToolRun) -> Path:
    """xtuner's `convert merge` (base + adapter → full model, safetensors), where `tools` runs it."""
    tools.into(python, "merge", out, base, adapter, out, "--device", device, "--safe-serialization")
    return check_hf_model(out)


def publish(src: Path, dest: str, s3_endpoint_url: str | None = None) -> str:
    """Copy a model folder to a local folder or an s3:// prefix; the destination is complete when it appears.

    Local: copy into `<dest>.tmp`, then rename. S3: upload every file, then a `_SUCCESS` marker last.
    Credentials come from the usual boto3 chain; they are never logged."""
    src = Path(src)
    if dest.startswith("s3://"):
        import boto3

        bucket, _, prefix = dest[len("s3://") :].partition("/")
        s3 = boto3.client("s3", endpoint_url=s3_endpoint_url)
        for f in sorted(p for p in src.rglob("*") if p.is_file()):
            s3.upload_file(str(f), bucket, f"{prefix.rstrip('/')}/{f.relative_to(src).as_posix()}")
        s3.put_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/_SUCCESS", Body=b"")
        return dest
    out = Path(dest)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return str(out)


#: the run folder's model, as the native backend lays it out: the Hugging Face model (merged for LoRA) in
#: `export/`, a LoRA run's PEFT adapter in `export/adapter/` (ADAPTER_DIR, the native export's name). Run folders from
#: before this layout hold `model/` and `adapter/`; their result.json names those, and readers go by the record.
EXPORT_DIR = "export"


def _swap_in(staged: Path, final: Path) -> Path:
    """Rename the finished `staged` folder to `final`, replacing an older one: a reader never sees half of it. Its
    files get the umask's mode first (safetensors' writer makes them 0600), as the native export's do."""
    share_mode(staged)
    if final.exists():
        shutil.rmtree(final)
    staged.rename(final)
    return final


def convert_checkpoint(
    plan: XTunerPlan,
    checkpoint: Path,
    *,
    log: Callable[[str], None] = print,
    publish_to: str | None = None,
    s3_endpoint_url: str | None = None,
    runner: Runner | None = None,
) -> dict[str, str | None]:
    """pth → HF (adapter for LoRA), merge when asked, then publish the final model folder. `runner`: where the
    XTuner env runs the tools (node 0, the node whose rank 0 wrote the checkpoint, for remote clusters).

    Written as the native backend writes it: `export/` the model (LoRA merged into the base), `export/adapter/`
    the adapter, staged in `export.tmp/` and renamed into place last. Returns `model_dir` (= `export_dir`, None for
    an unmerged adapter), `adapter_dir` and `published`."""
    run_dir = Path(plan.run_dir)
    tools = ToolRun(Path(plan.log_dir) / "convert.log", log, runner=runner, wrapper=plan.wrapper)
    lora = plan.method in ("lora", "qlora")
    staged = run_dir / f"{EXPORT_DIR}.tmp"
    if staged.exists():
        shutil.rmtree(staged)
    if not lora:
        pth_to_hf(plan.python, Path(plan.config_path), checkpoint, staged, lora=False, tools=tools)
    else:
        adapter = pth_to_hf(
            plan.python, Path(plan.config_path), checkpoint, run_dir / f"{ADAPTER_DIR}.tmp", lora=True, tools=tools
        )
        device = "cpu" if plan.profile == "cpu" else "cuda"
        if plan.merge_lora:  # the merged model is the export; the adapter goes inside it, as natively
            merge_lora(plan.python, Path(plan.base_model), adapter, staged, device=device, tools=tools)
        else:
            staged.mkdir()
        adapter.rename(staged / ADAPTER_DIR)
    export = _swap_in(staged, run_dir / EXPORT_DIR)
    has_model = not lora or plan.merge_lora
    out: dict[str, str | None] = {
        "model_dir": str(check_hf_model(export)) if has_model else None,
        "adapter_dir": str(check_adapter(export / ADAPTER_DIR)) if lora else None,
    }
    final = out["model_dir"] or out["adapter_dir"]
    out["published"] = publish(Path(final), publish_to, s3_endpoint_url) if publish_to else final
    return out
