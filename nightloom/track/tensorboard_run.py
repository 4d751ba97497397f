"""TensorBoard event files (torch.utils.tensorboard's SummaryWriter): every step's figures as scalars under
`train/`, the flow's parameters, verdicts and summary as text; the folder is its own "run id"."""

from __future__ import annotations

import json
from pathlib import Path

from nightloom.spec.tracking import TensorBoardTrack
from nightloom.track.sink import StepValues


def tensorboard_folder(settings: TensorBoardTrack, run_dir: str | Path) -> Path:
    folder = Path(settings.folder).expanduser()
    return folder if folder.is_absolute() else Path(run_dir) / folder


class TensorBoardRun:
    name = "tensorboard"

    def __init__(self, settings: TensorBoardTrack, run_dir: str | Path):
        self.folder = tensorboard_folder(settings, run_dir)
        self.where = str(self.folder)
        self.writer = None

    def open(self) -> str:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.folder), flush_secs=5)
        return str(self.folder)

    def log_metrics(self, rows: list[StepValues]) -> None:
        for r in rows:
            for k, v in r.values.items():
                self.writer.add_scalar(f"train/{k}", v, r.step, walltime=r.time)

    def close(self) -> None:
        self.writer.close()

    def log_params(self, params: dict[str, str]) -> None:
        self.writer.add_text("params", "\n\n".join(f"`{k}`: {v}" for k, v in params.items()))

    def log_values(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.writer.add_text("tags", json.dumps(tags, indent=1))

    def log_artifact(self, path: Path) -> None:
        if path.suffix in (".json", ".txt", ".md"):
            self.writer.add_text(f"artifacts/{path.name}", path.read_text()[:100_000])

    def finish(self, succeeded: bool) -> None:
        self.writer.close()
