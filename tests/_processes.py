"""Test helpers shared by the training tests: one torch thread, and several processes run to their end together
(nodes of one run on 127.0.0.1)."""

from __future__ import annotations

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


def run_together(commands: Sequence[Sequence[str]], env: dict[str, str], cwd: str | Path,
                 limit_s: float) -> list[tuple[int, str]]:
    """Start every command at once, wait for all (``limit_s`` each), kill what is left; (exit code, output) each."""
    procs = [subprocess.Popen(list(c), env=env, cwd=cwd, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for c in commands]
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
