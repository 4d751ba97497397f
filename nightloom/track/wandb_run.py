"""A Weights & Biases run (the `wandb` client): offline by default, its files under the run folder's wandb/ (`wandb
sync` sends them later); online with WANDB_API_KEY from the environment only. A relaunched attempt and the flow's
end-of-run logging resume the same run id; the client keeps no key in the files it writes."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

from nightloom.spec.tracking import WandbTrack
from nightloom.track.sink import StepValues


class WandbRun:
    name = "wandb"

    def __init__(self, settings: WandbTrack, run_name: str, run_dir: str | Path, run_id: str | None = None):
        self.settings, self.run_name, self.run_id = settings, run_name, run_id
        self.dir = Path(run_dir)
        self.where = f"{settings.mode}: {self.dir / 'wandb'}" if settings.mode == "offline" else settings.project
        self.run = None

    def open(self) -> str:
        import wandb

        s = self.settings
        self.run = wandb.init(
            project=s.project,
            entity=s.entity,
            mode=s.mode,
            dir=str(self.dir),
            id=self.run_id or secrets.token_hex(4),
            name=self.run_name,
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_machine_info=True),
        )
        self.run_id = self.run.id
        return self.run_id

    def log_metrics(self, rows: list[StepValues]) -> None:
        for r in rows:
            self.run.log(r.values, step=r.step)

    def close(self) -> None:
        self.run.finish()

    # -- the flow's end-of-run logging (the run's config and summary: W&B's steps only go forward)

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_values(self, values: dict[str, float], step: int) -> None:
        self.run.summary.update(values)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.run.summary.update(tags)

    def log_artifact(self, path: Path) -> None:
        """Copied into the run's own files folder (an offline run has no artifact store to upload to)."""
        shutil.copy2(path, Path(self.run.dir) / path.name)

    def finish(self, succeeded: bool) -> None:
        self.run.finish(exit_code=0 if succeeded else 1)
