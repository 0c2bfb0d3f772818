"""torchvision's NMS operator, loaded without importing torchvision.

``import torchvision`` costs a process ~2 s of CPU (its ``ops`` package imports ``torch._dynamo``), and every
rank that validates needs NMS: in a test suite or a job that starts many processes that adds up. The operator
itself lives in torchvision's compiled extension, which registers ``torch.ops.torchvision.nms`` when loaded; the
Python ``torchvision.ops.nms`` only calls that operator. So where torchvision is not imported yet, the extension
is loaded on its own (a few ms), and anything that goes wrong there falls back to importing torchvision, which
gives its own error where torchvision is broken or missing.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

_STEMS = ("_C", "_C_stable")  # the extension's name: _C up to torchvision 0.23, _C_stable in the later builds


@functools.cache
def nms_kernel() -> Callable[[Tensor, Tensor, float], Tensor]:
    """``nms(boxes_xyxy, scores, iou_threshold) -> kept indices, best first``: torchvision's operator.

    >>> keep = nms_kernel()(torch.tensor([[0., 0, 2, 2], [0, 0, 2, 2.1]]), torch.tensor([0.9, 0.8]), 0.5)
    >>> keep.tolist()
    [0]
    """
    if "torchvision" not in sys.modules:
        op = _extension_operator()
        if op is not None:
            return op
    from torchvision.ops import nms

    return nms


def _extension_operator() -> Callable[[Tensor, Tensor, float], Tensor] | None:
    """``torch.ops.torchvision.nms`` from torchvision's extension loaded by itself, or None where it is not found
    or does not load."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    for stem in _STEMS:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = folder / f"{stem}{suffix}"
            if not path.is_file():
                continue
            try:
                torch.ops.load_library(str(path))
                return torch.ops.torchvision.nms
            except (OSError, AttributeError, RuntimeError):
                return None
    return None
