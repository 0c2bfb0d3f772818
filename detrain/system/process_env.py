"""This process's environment as other programs read it: the engine reads and writes no environment variable itself
(``tests/unit/test_world.py`` checks), so the two settings it makes for other programs live here.

* cuBLAS chooses deterministic kernels only with a fixed workspace, which it reads from ``CUBLAS_WORKSPACE_CONFIG``
  when its first handle is made: :func:`ask_deterministic_cublas` sets it, unless the user did, before that.
* git, run to record detrain's own commit, must not follow a ``GIT_DIR`` (or any ``GIT_*``) meant for another
  repository: :func:`without_git_variables`.
* The experiment trackers (MLflow, W&B) take their destination from the user's own variables, and must not send
  anything the user did not ask for: :func:`tracker_settings` reads the ones detrain honours,
  :func:`quiet_trackers` switches MLflow's telemetry and W&B's error reporting off unless the user chose, and
  :func:`allow_mlflow_file_store` lets MLflow write the local store detrain picks.

>>> "GIT_DIR" in without_git_variables({"GIT_DIR": "/elsewhere", "HOME": "/home/me"})
False
"""

from __future__ import annotations

import os
from collections.abc import Mapping

CUBLAS_WORKSPACE = ":4096:8"  # one of the two workspace sizes NVIDIA documents for deterministic cuBLAS


def ask_deterministic_cublas() -> None:
    """Ask cuBLAS for deterministic kernels (``CUBLAS_WORKSPACE_CONFIG``), unless the user set the workspace."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def without_git_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (``os.environ`` unless given) without git's own variables, for running git on detrain's checkout."""
    return {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("GIT_")}


def tracker_settings() -> dict[str, str]:
    """The tracker variables the user set (empty ones left out): ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``,
    ``WANDB_MODE``, ``WANDB_PROJECT``."""
    names = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT")
    return {k: os.environ[k] for k in names if os.environ.get(k)}


def quiet_trackers() -> None:
    """No usage telemetry from MLflow and no error reports from W&B, unless the user set these variables."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")


def allow_mlflow_file_store() -> None:
    """MLflow 3 refuses its file store (in maintenance mode) unless this is set; detrain uses it only when the user
    named no tracking URI."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def has_display() -> bool:
    """Whether a window system is there to show a picture in (``DISPLAY`` or ``WAYLAND_DISPLAY`` set)."""
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
