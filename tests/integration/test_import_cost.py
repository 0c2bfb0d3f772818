"""What a fresh process imports: torch's heavy packages (``torch._dynamo`` with ``torch._inductor``, the fsdp and
DTensor packages with sympy, torchvision) cost a process seconds of CPU, and a job or a test suite starts many.
The launcher, a DDP rank's model code, NMS and the deterministic switch must not import them for nothing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _processes import REPO, child_env

from detrain.nn import nms_kernel

pytestmark = pytest.mark.integration

_PROBE = r"""
import json, sys
import torch
from torch import nn

import detrain.cli, detrain.distributed.launch.launcher, detrain.engine.train.trainer  # what a launcher imports
from detrain.distributed import parallel
from detrain.engine.train import accumulation, ema, nonfinite, reproduce
from detrain.engine.train.recipe import optim
from detrain.nn.postprocess import non_max_suppression

HEAVY = ("torchvision", "torch._dynamo", "torch._inductor", "torch.distributed.fsdp", "torch.distributed.tensor")
seen = {}
net = nn.Linear(2, 2)
net(torch.ones(1, 2)).sum().backward()
seen["probes"] = [parallel.is_sharded(net), any(optim.probe.is_dtensor(p) for p in net.parameters())]
accumulation.average_over_ranks(net)  # one process: nothing to average, and nothing sharded
ema.ModelEMA(net).gather(net)
seen["norm"] = float(nonfinite.gradient_norm(list(net.parameters()), clip=10.0))
reproduce.seed_everything(0, deterministic=True)
seen["deterministic"] = [
    torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
]
g = torch.Generator().manual_seed(0)
xy = torch.rand(1, 2, 400, generator=g) * 100
preds = torch.cat([xy, torch.rand(1, 2, 400, generator=g) * 30 + 5, torch.rand(1, 3, 400, generator=g)], 1)
dets = non_max_suppression(preds, conf_thres=0.3, iou_thres=0.5)[0]
seen["heavy"] = [m for m in HEAVY if m in sys.modules]
boxes, scores = dets[:, :4] + dets[:, 5:6] * 7680, dets[:, 4]
from torchvision.ops import nms  # now torchvision's own Python operator, for the comparison
seen["kept"] = len(dets)
seen["nms_equal"] = nms(boxes, scores, 0.5).tolist() == list(range(len(dets)))
from detrain.engine.train import setup
setup.compile_model(net, "aot_eager", print)  # torch.compile is lazy: nothing compiles before a forward
import torch._inductor.config as inductor_config
seen["inductor_deterministic"] = inductor_config.deterministic
print(json.dumps(seen))
"""


def test_a_launcher_and_a_ranks_model_code_import_none_of_torchs_heavy_packages(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=child_env(), cwd=REPO, text=True, capture_output=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["heavy"] == []
    assert seen["probes"] == [False, False]
    assert seen["deterministic"] == [True, True]  # what torch.use_deterministic_algorithms(True, warn_only=True) sets
    assert seen["kept"] > 10  # NMS ran on the extension's operator and kept boxes ...
    assert seen["nms_equal"]  # ... the ones torchvision's keeps, in its order (best first)
    assert seen["inductor_deterministic"] is True  # a compiled run's inductor gets the process's switch


def test_the_nms_kernel_is_torchvisions_operator_or_falls_back_to_importing_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torchvision.ops import nms

    spec = importlib.util.find_spec("torchvision")
    assert spec is not None
    monkeypatch.setattr(nms_kernel.importlib.util, "find_spec", lambda name: None)
    assert nms_kernel._extension_operator() is None  # no torchvision to find
    empty = type(spec)("torchvision", None, is_package=True)
    empty.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(nms_kernel.importlib.util, "find_spec", lambda name: empty)
    assert nms_kernel._extension_operator() is None  # a torchvision without its extension
    (tmp_path / "_C.so").write_bytes(b"\x7fELF not a library")
    assert nms_kernel._extension_operator() is None  # one that does not load
    monkeypatch.undo()
    assert nms_kernel._extension_operator() is torch.ops.torchvision.nms
    nms_kernel.nms_kernel.cache_clear()
    assert nms_kernel.nms_kernel() is nms  # torchvision imported already: its own function
