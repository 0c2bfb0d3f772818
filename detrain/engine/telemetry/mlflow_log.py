"""A training run mirrored into MLflow (``mlflow=true``, ``pip install "detrain[mlflow]"``), from rank 0: the run's
arguments as parameters, each epoch's results.csv row as metrics at step = epoch, and best.pt, results.csv and
args.yaml as artifacts when the run ends.

Where it goes: ``$MLFLOW_TRACKING_URI`` when the user set one (their server, or their store), else a local file
store beside the run folders (``<project>/mlflow``, read with ``mlflow ui --backend-store-uri <that folder>``).
Nothing contacts a server the user did not name: MLflow's usage telemetry is switched off unless the user's own
``MLFLOW_DISABLE_TELEMETRY`` says otherwise, and the local store needs MLflow's ``MLFLOW_ALLOW_FILE_STORE`` (its
file backend is in maintenance mode), which is set for this process only when detrain chose that store.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detrain.errors import ConfigError
from detrain.system.process_env import allow_mlflow_file_store, quiet_trackers, tracker_settings

INSTALL = 'mlflow=true needs MLflow: pip install "detrain[mlflow]"'
_PARAMS_PER_CALL = 100  # MLflow's limit for one batch of parameters
_PARAM_CHARS = 6000  # MLflow's limit for one parameter's value
_NAME = re.compile(r"[^A-Za-z0-9_\-./ ]")


def require() -> Any:
    """The mlflow module, or the install line as a ConfigError (checked before any process starts)."""
    quiet_trackers()
    try:
        import mlflow
    except ImportError:
        raise ConfigError(INSTALL) from None
    return mlflow


def metric_name(column: str) -> str:
    """A results.csv column as an MLflow metric name (MLflow allows letters, digits, _ - . / and spaces).

    >>> metric_name("metrics/mAP50-95"), metric_name("node0/gpu_mem_gb"), metric_name("lr(pg0)")
    ('metrics/mAP50-95', 'node0/gpu_mem_gb', 'lr_pg0_')
    """
    return _NAME.sub("_", column)


class MLflowRun:
    """One MLflow run for one training run (rank 0 only)."""

    def __init__(self, save_dir: Path, args: Mapping[str, Any]) -> None:
        self.mlflow = require()
        settings = tracker_settings()
        uri = settings.get("MLFLOW_TRACKING_URI")
        if uri is None:
            uri = (save_dir.parent / "mlflow").absolute().as_uri()
            allow_mlflow_file_store()
        self.uri = uri
        self.mlflow.set_tracking_uri(uri)
        self.mlflow.set_experiment(settings.get("MLFLOW_EXPERIMENT_NAME", "detrain"))
        self.run = self.mlflow.start_run(run_name=save_dir.name)
        items = [(k, str(v)[:_PARAM_CHARS]) for k, v in args.items()]
        for i in range(0, len(items), _PARAMS_PER_CALL):
            self.mlflow.log_params(dict(items[i : i + _PARAMS_PER_CALL]))

    def add_row(self, scalars: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics({metric_name(k): float(v) for k, v in scalars.items()}, step=step)

    def close(self, files: list[Path], status: str) -> None:
        """Artifacts (``files`` that exist), then the run's end: FINISHED, or FAILED / KILLED."""
        for path in files:
            if path.is_file():
                self.mlflow.log_artifact(str(path))
        self.mlflow.end_run(status=status)
