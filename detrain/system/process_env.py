"""This process's environment as other programs read it: the engine reads and writes no environment variable itself
(``tests/unit/test_world.py`` checks), so the two settings it makes for other programs live here.

* cuBLAS chooses deterministic kernels only with a fixed workspace, which it reads from ``CUBLAS_WORKSPACE_CONFIG``
  when its first handle is made: :func:`ask_deterministic_cublas` sets it, unless the user did, before that.
* git, run to record detrain's own commit, must not follow a ``GIT_DIR`` (or any ``GIT_*``) meant for another
  repository: :func:`without_git_variables`.

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
