"""Parse XTuner/mmengine training logs into nightloom's StepMetrics JSONL, so validation, ledger and plots work unchanged.

mmengine writes one folder per launch, `<work_dir>/<YYYYMMDD_HHMMSS>/`, holding `vis_data/scalars.json` (one
JSON object per logged iteration: `step`, `loss`, `lr`, `time`, `grad_norm`, `memory`...) and
`<stamp>.log`. A resume starts a new folder; its first step is marked `gap`. When a step appears in several
launches, the latest launch wins (it is what the final weights came from).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from nightloom.metrics import StepMetrics, append_metrics

_STAMP = re.compile(r"^\d{8}_\d{6}$")
# mmengine text log line: "... Iter(train) [  3/6]  lr: 1.0e-03  eta: ... time: 0.51  data_time: ...  loss: 5.71"
_LOG_LINE = re.compile(r"Iter\(train\)\s*\[\s*(\d+)/\s*\d+\]\s+(.*)$")
_KV = re.compile(r"([a-z_]+):\s*(-?[0-9.]+(?:e[-+]?\d+)?|nan|inf)", re.IGNORECASE)


# a record of mmengine's logger, once launcher prefixes ("[train] [node] ") are stripped: "12/05 12:26:57 - mmengine - INFO - msg"
_RECORD = re.compile(r"^\d{2}/\d{2} \d{2}:\d{2}:\d{2} - \S+ - [A-Z]+ -(?: (.*))?$")
_PREFIXES = re.compile(r"^(?:\[[^\]\n]*\] ?)+")
_DASH_LINE = "-" * 60  # mmengine frames its environment block with these
# the first line of each of the start-up dumps: environment (an empty message, the block follows), config, hook order
_DUMP_STARTS = {"": "env", "Config:": "config", "Hooks will be executed in the following order:": "hooks"}


class StartupDump:
    """Keeps mmengine's start-up dump (system and runtime environment, the whole config, the hook order: ~300
    lines before the first step) out of the live log; the full log file still has every line.

    Called with each output line (launcher prefixes and all), it returns the lines to show: none inside a dump,
    and once a dump is over one note saying how many lines went to `where` before the next line shown."""

    def __init__(self, where: str | Path):
        self.where, self.mode, self.hidden, self.dashes, self.prefix = str(where), None, 0, 0, ""

    def __call__(self, text: str) -> list[str]:
        """The lines to show for the output line `text` (none while inside a dump)."""
        body = _PREFIXES.sub("", text).rstrip()
        record = _RECORD.match(body)
        if self.mode is not None and (record or body.startswith("Traceback")):
            self.mode = None  # the next record (or a crash) ends the config and hook listings
        if self.mode is None and record and (record.group(1) or "").strip() in _DUMP_STARTS:
            self.mode, self.dashes = _DUMP_STARTS[(record.group(1) or "").strip()], 0
            self.prefix = text[: len(text) - len(text.lstrip())] + (_PREFIXES.match(text.lstrip()) or [""])[0]
        if self.mode is None:
            if self.hidden and not body:
                self.hidden += 1  # the blank line mmengine ends a dump with
                return []
            return [*self.flush(), text]
        self.hidden += 1
        if self.mode == "env":
            self.dashes += body == _DASH_LINE
            self.mode = None if self.dashes == 2 else "env"
        elif self.mode == "config" and not body:
            self.mode = None
        return []

    def flush(self) -> list[str]:
        """The note for the lines hidden since the last one shown ([] when none were)."""
        if not self.hidden:
            return []
        n, self.hidden = self.hidden, 0
        return [f"{self.prefix}({n} lines of mmengine's start-up listing (environment, config, hooks): {self.where})"]


class XTunerLogError(ValueError):
    """No usable metrics in an XTuner work dir; the message names the folder or file and line."""


@dataclass(frozen=True)
class RunShape:
    """What a step means in tokens and FLOPs: for tokens/s and MFU (nightloom.perf, PaLM App. B)."""

    tokens_per_step: int  # global: sequences per step × packed length
    flops_per_token: float | None = None
    n_devices: int = 1
    peak_flops_per_device: float | None = None


def step_of(line: str) -> int | None:
    """The step of an mmengine `Iter(train) [N/M]` progress line (as streamed, prefixes and all), else None."""
    m = _LOG_LINE.search(line)
    return int(m.group(1)) if m else None


def launch_dirs(work_dir: Path) -> list[Path]:
    """mmengine's per-launch folders in launch order."""
    work_dir = Path(work_dir)
    return sorted(d for d in work_dir.iterdir() if d.is_dir() and _STAMP.match(d.name)) if work_dir.is_dir() else []


def _from_scalars(path: Path) -> list[dict]:
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                break  # a line being written when the run died: drop it
            raise XTunerLogError(f"{path}:{i}: corrupt JSON ({e.msg})") from None
        if "loss" in obj and ("step" in obj or "iter" in obj):
            rows.append(obj)
    return rows


def _from_text_log(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = _LOG_LINE.search(line)
        if not m:
            continue
        kv = {k: float(v) for k, v in _KV.findall(m.group(2))}
        if "loss" in kv:
            rows.append({"step": int(m.group(1)), **kv})
    return rows


def parse_launch(launch_dir: Path) -> list[dict]:
    """Per-iteration records of one launch: vis_data/scalars.json, else the text log."""
    scalars = launch_dir / "vis_data" / "scalars.json"
    if scalars.is_file():
        return _from_scalars(scalars)
    logs = sorted(launch_dir.glob("*.log"))
    return _from_text_log(logs[0]) if logs else []


def collect_steps(work_dir: Path, shape: RunShape, attempt: int = 0) -> list[StepMetrics]:
    """All optimizer steps of a work dir, one StepMetrics each, ordered by step."""
    by_step: dict[int, StepMetrics] = {}
    for n, d in enumerate(launch_dirs(work_dir)):
        rows = parse_launch(d)
        for j, r in enumerate(rows):
            step = int(r.get("step", r.get("iter")))
            t = r.get("time")
            tps = shape.tokens_per_step / t if t else None
            mfu = None
            if tps and shape.flops_per_token and shape.peak_flops_per_device:
                from nightloom.perf import mfu as mfu_of

                mfu = mfu_of(tps, shape.flops_per_token, shape.n_devices, shape.peak_flops_per_device)
            mem = r.get("memory")  # MiB: CUDA allocator (mmengine), or CPU peak RSS (xtuner_ext/nightloom_memory.py)
            by_step[step] = StepMetrics(
                step=step,
                loss=float(r["loss"]),
                lr=r.get("lr"),
                grad_norm=r.get("grad_norm"),
                tokens=shape.tokens_per_step,
                step_time_s=t,
                tokens_per_s=tps,
                mfu=mfu,
                peak_mem_bytes=int(mem * 2**20) if mem is not None else None,
                attempt=attempt + n,
                gap=(n > 0 and j == 0),
                data_time_s=r.get("data_time"),
            )
    return [by_step[k] for k in sorted(by_step)]


def write_metrics(work_dir: Path, out: Path, shape: RunShape, attempt: int = 0) -> list[StepMetrics]:
    """Rewrite `out` (atomically) with the metrics of every launch in `work_dir`; error when there are none."""
    steps = collect_steps(work_dir, shape, attempt)
    if not steps:
        raise XTunerLogError(f"{work_dir}: no training steps logged (no vis_data/scalars.json or Iter(train) lines)")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    for m in steps:
        append_metrics(tmp, m)
    tmp.replace(out)
    return steps
