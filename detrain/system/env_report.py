"""``detrain checks``: what this machine offers for training.

>>> "torch" in report()
True
"""

from __future__ import annotations

import os
import platform
import sys

import cv2
import numpy as np
import torch
import torch.distributed as tdist
import torchvision

from detrain import __version__


def report() -> str:
    """A few lines: versions, CPU, CUDA devices, NCCL/gloo availability."""
    lines = [
        f"detrain {__version__}",
        f"python {sys.version.split()[0]} on {platform.platform()}",
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, numpy {np.__version__}, "
        f"opencv {cv2.__version__}",
        f"cpu: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        f"distributed: available {tdist.is_available()}, gloo {tdist.is_available() and tdist.is_gloo_available()}, "
        f"nccl {tdist.is_available() and tdist.is_nccl_available()}",
    ]
    if torch.cuda.is_available():
        lines.append(
            f"cuda {torch.version.cuda}, cudnn {torch.backends.cudnn.version()}, "
            f"{torch.cuda.device_count()} device(s), bf16 {torch.cuda.is_bf16_supported()}"
        )
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("cuda: not available (training runs on the CPU)")
    return "\n".join(lines)
