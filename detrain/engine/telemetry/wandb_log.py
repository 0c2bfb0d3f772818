"""A training run mirrored into Weights & Biases (``wandb=true``, ``pip install "detrain[wandb]"``), from rank 0:
the run's arguments as its config, each epoch's results.csv row at step = epoch, and best.pt as a ``model``
artifact (results.csv and args.yaml in the run's files) when the run ends.

Offline unless the user says otherwise: ``WANDB_MODE`` is theirs to set (``online`` after ``wandb login``); unset,
the run is written to ``<run folder>/wandb/offline-run-*`` and nothing is sent (``wandb sync`` uploads it later).
W&B's error reporting is switched off unless the user's own ``WANDB_ERROR_REPORTING`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detrain.errors import ConfigError
from detrain.system.process_env import quiet_trackers, tracker_settings

INSTALL = 'wandb=true needs Weights & Biases: pip install "detrain[wandb]"'


def require() -> Any:
    """The wandb module, or the install line as a ConfigError (checked before any process starts)."""
    quiet_trackers()
    try:
        import wandb
    except ImportError:
        raise ConfigError(INSTALL) from None
    return wandb


class WandbRun:
    """One W&B run for one training run (rank 0 only)."""

    def __init__(self, save_dir: Path, args: Mapping[str, Any]) -> None:
        self.wandb = require()
        settings = tracker_settings()
        self.mode = settings.get("WANDB_MODE", "offline")
        self.run = self.wandb.init(
            project=settings.get("WANDB_PROJECT", "detrain"),
            name=save_dir.name,
            dir=str(save_dir),
            config=dict(args),
            mode=self.mode,
            reinit="create_new",
        )

    def add_row(self, scalars: Mapping[str, float], step: int) -> None:
        self.run.log({k: float(v) for k, v in scalars.items()}, step=step)

    def close(self, files: list[Path], status: str) -> None:
        """best.pt as a model artifact, the other ``files`` saved with the run; then the run's end (exit code 1
        unless FINISHED)."""
        for path in files:
            if not path.is_file():
                continue
            if path.suffix == ".pt":
                artifact = self.wandb.Artifact(f"{self.run.id}-{path.stem}", type="model")
                artifact.add_file(str(path))
                self.run.log_artifact(artifact)
            else:
                self.run.save(str(path), base_path=str(path.parent), policy="now")
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
