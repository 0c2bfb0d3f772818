"""Test helpers shared by the training tests: one torch thread, and several processes run to their end together
(nodes of one run on 127.0.0.1)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny convolutions run far slower with 2 threads on a 2-core machine than with 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_together(
    commands: Sequence[Sequence[str]], env: dict[str, str], cwd: str | Path, limit_s: float
) -> list[tuple[int, str]]:
    """Start every command at once, wait for all (``limit_s`` each), kill what is left; (exit code, output) each."""
    procs = [
        subprocess.Popen(list(c), env=env, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for c in commands
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=limit_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


REPO = Path(__file__).resolve().parents[1]
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TEST_FAULT",
)


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The run secret of the runs of several nodes the tests start on 127.0.0.1 (each node's launcher is given it, as
# a user gives every node DETRAIN_RUN_SECRET); a run on one node makes its own and ignores it.
RUN_SECRET = "tests-" + secrets.token_hex(16)


def child_env(**extra: str) -> dict[str, str]:
    """A child environment outside any launcher or SLURM job: one thread per process, this checkout's detrain, the
    tests' run secret (:data:`RUN_SECRET`, for runs of several nodes)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["DETRAIN_RUN_SECRET"] = RUN_SECRET
    env.update(extra)
    return env
