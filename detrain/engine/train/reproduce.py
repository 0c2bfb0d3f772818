"""What makes a run repeatable and resumable: seeding, every random generator's state (stored in checkpoints
in a form ``torch.load(weights_only=True)`` accepts), and finding the checkpoint ``resume`` means."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detrain.config.cfg import Cfg
from detrain.errors import ConfigError
from detrain.system.process_env import ask_deterministic_cublas


def rng_state() -> dict[str, Any]:
    """Every random generator a run uses, so that resume continues exactly."""
    legacy = np.random.get_state()
    assert isinstance(legacy, tuple)  # the global generator is MT19937, whose state numpy gives as this tuple
    name, keys, pos, has_gauss, gauss = legacy
    # numpy's key array as a tensor: checkpoints hold only what torch.load(weights_only=True) accepts
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        # this rank's own device only: a resume may see fewer GPUs (8 -> 4, a requeue under srun's per-task binding)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back the generators :func:`rng_state` saved (CUDA's only where CUDA is available: into this rank's
    current device)."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    cuda = _own_cuda_state(state.get("cuda"))
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _own_cuda_state(saved: Any) -> torch.Tensor | None:
    """The CUDA generator state for this rank's current device: the one a checkpoint keeps per rank, or, from an
    older checkpoint's list of every device's state, the entry at the current device's index (the device this rank
    used where the layout is unchanged); None where the list has no such entry (the GPUs changed: the generator
    keeps its seed)."""
    if saved is None or isinstance(saved, torch.Tensor):
        return saved
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return saved[index] if index < len(saved) else None


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python, numpy and torch; with ``deterministic``, ask torch (and cuBLAS) for deterministic kernels;
    without, let cuDNN time its kernels for the run's shapes and keep the fastest (``cudnn.benchmark``: CUDA
    convolutions only, which then may differ from run to run; nothing changes on the CPU)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.benchmark = not deterministic
    if deterministic:
        deterministic_kernels()
        torch.backends.cudnn.deterministic = True
        ask_deterministic_cublas()


def deterministic_kernels() -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` without its import of ``torch._inductor``
    (which sets inductor's own flag, and costs every rank ~3 s of CPU: dynamo, fsdp, sympy). Only compiled code
    reads inductor's flag: :func:`carry_to_compiler` sets it where a run compiles, and here where inductor is
    imported already."""
    switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if switch is None:  # a torch without the private switch: the public call, import and all
        torch.use_deterministic_algorithms(True, warn_only=True)
        return
    switch(True, warn_only=True)
    inductor_config: Any = sys.modules.get("torch._inductor.config")  # a module found at run time: no static type
    if inductor_config is not None:
        inductor_config.deterministic = True


def carry_to_compiler() -> None:
    """Before ``torch.compile``: inductor's deterministic flag set as the process's (the public call sets both)."""
    torch.use_deterministic_algorithms(
        torch.are_deterministic_algorithms_enabled(), warn_only=torch.is_deterministic_algorithms_warn_only_enabled()
    )


def find_resume_checkpoint(cfg: Cfg) -> Path:
    """``resume=path`` -> that file; ``resume=True`` -> last.pt of project/name (or the newest run)."""
    if isinstance(cfg.train.resume, str):
        path = Path(cfg.train.resume)
    else:
        root = Path(cfg.output.project) if cfg.output.project else Path("runs") / "train"
        if cfg.output.name:
            path = root / cfg.output.name / "weights" / "last.pt"
        else:
            candidates = sorted(root.glob("*/weights/last.pt"), key=lambda p: p.stat().st_mtime)
            if not candidates:
                raise ConfigError(f"resume=True but no {root}/*/weights/last.pt exists; pass resume=path/to/last.pt")
            path = candidates[-1]
    if not path.is_file():
        raise ConfigError(f"resume: checkpoint not found: {path}")
    return path
