"""The experiment trackers a run feeds from rank 0, behind one object: TensorBoard (``tensorboard=true``), MLflow
(``mlflow=true``) and Weights & Biases (``wandb=true``). Each gets every results.csv row (the losses, metrics,
learning rates, speed and per-node monitoring columns) at step = epoch; MLflow and W&B also get the run's
arguments when it starts and best.pt, results.csv and args.yaml when it ends.

A tracker that is asked for and not installed is one line naming the extra to install, before any process
starts (:func:`check`); other ranks hold no tracker.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detrain.config.cfg import Cfg
from detrain.log import TensorBoard


def check(cfg: Cfg) -> None:
    """Raise the install line of a tracker that ``cfg`` asks for and this Python lacks."""
    if cfg.output.mlflow:
        from detrain.engine.telemetry import mlflow_log

        mlflow_log.require()
    if cfg.output.wandb:
        from detrain.engine.telemetry import wandb_log

        wandb_log.require()


class RunLoggers:
    """TensorBoard, MLflow and W&B as ``cfg`` asks, on rank 0 (``main``); nothing elsewhere."""

    def __init__(self, save_dir: Path, cfg: Cfg, main: bool) -> None:
        self.save_dir = save_dir
        self.tb = TensorBoard(save_dir, cfg.output.tensorboard and main)
        self.trackers: list[Any] = []
        if main and cfg.output.mlflow:
            from detrain.engine.telemetry.mlflow_log import MLflowRun

            self.trackers.append(MLflowRun(save_dir, cfg.to_dict()))
        if main and cfg.output.wandb:
            from detrain.engine.telemetry.wandb_log import WandbRun

            self.trackers.append(WandbRun(save_dir, cfg.to_dict()))

    def add_row(self, scalars: Mapping[str, float], step: int) -> None:
        """One results.csv row (without its epoch column) at step ``step`` (the epoch, from 1)."""
        self.tb.log(scalars, step)
        for tracker in self.trackers:
            tracker.add_row(scalars, step)

    def close(self, status: str = "FINISHED") -> None:
        """End every tracker's run (``status``: FINISHED, FAILED or KILLED), with the run's files as artifacts."""
        self.tb.close()
        files = [self.save_dir / "weights" / "best.pt", self.save_dir / "results.csv", self.save_dir / "args.yaml"]
        trackers, self.trackers = self.trackers, []  # closed once, whatever raises
        for tracker in trackers:
            tracker.close(files, status)
